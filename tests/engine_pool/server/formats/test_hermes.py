"""formats/hermes.py and formats/calls.py: `<tool_call>{json}</tool_call>` blocks into OpenAI tool calls,
whole and streamed, and the forced-call grammar judged by llama.cpp."""

from __future__ import annotations

import json

from engine_pool.server.formats import FORMATS, ToolCall
from engine_pool.server.formats.calls import CallStream

from .conftest import Accepts, Generate, assert_chunkings_read_as_whole, read_whole

HERMES = FORMATS["hermes"]
TEXT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"utc\\"}"}\n</tool_call>'
)
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["unit"],
}


def stream() -> CallStream:
    return HERMES.stream([])


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    msg = read_whole(stream(), text)
    return msg.content, msg.calls


def test_parse_content_and_calls() -> None:
    content, calls = parse(TEXT)
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert json.loads(calls[1].arguments) == {"tz": "utc"}
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")


def test_only_calls_means_no_content() -> None:
    content, calls = parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n')
    assert content is None and calls[0].arguments == "{}"


def test_a_block_that_is_not_a_call_stays_in_the_content() -> None:
    for text in (
        "a <tool_call>not json</tool_call> b",
        'x <tool_call>{"name": "f"',
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',  # not JSON for anyone else
        "<tool_call>" + "[" * 100_000 + "</tool_call>",  # deeper than Python's JSON parser goes
    ):
        assert parse(text) == (text, [])


def test_an_unclosed_block_that_parses_is_a_call() -> None:
    # Generation may stop on `</tool_call>` as a stop string, or on end-of-generation.
    content, calls = parse('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1})]


def test_plain_text_is_untouched() -> None:
    assert parse("  hello <tool  ") == ("  hello <tool  ", [])


def test_random_chunkings_give_the_whole_result() -> None:
    assert_chunkings_read_as_whole(stream, TEXT, seed=1)


def test_streaming_releases_content_before_the_tag_is_complete() -> None:
    s = stream()
    assert s.feed("Hi <tool") == ["Hi "]
    assert s.feed("box>") == ["<toolbox>"]


def test_forced_grammar_is_the_format_and_accepted_by_llama_cpp(accepts: Accepts) -> None:
    grammar = HERMES.grammar([("get_weather", WEATHER), ("noop", {})])
    assert accepts(grammar, '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"}}\n</tool_call>')
    assert accepts(grammar, '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')
    assert not accepts(grammar, '<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>')
    assert not accepts(grammar, '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>')


def test_generated_calls_parse_into_the_forced_call(generate: Generate) -> None:
    grammar = HERMES.grammar([("get_weather", WEATHER)])
    for seed in range(3):
        out = generate(grammar, seed)
        assert out.stop_reason == "eos", out.text
        content, calls = parse(out.text)
        assert content is None and [c.name for c in calls] == ["get_weather"]
        args = json.loads(calls[0].arguments)
        assert args["unit"] in ("c", "f") and set(args) <= {"city", "unit"}

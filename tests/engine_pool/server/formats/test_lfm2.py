"""formats/lfm2.py: `<|tool_call_start|>[name(k=v, ...)]<|tool_call_end|>` calls, whole and streamed; the
forced-call grammar judged by llama.cpp and by what a model writes under it."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

import native
from engine_pool.errors import BadRequest
from engine_pool.server.formats import FORMATS, ToolCall

from .conftest import (
    Accepts,
    Generate,
    assert_chunkings_read_as_whole,
    named_arguments,
    read_whole,
    weather_schema,
)

LFM2 = FORMATS["lfm2"]
TEXT = (
    'Checking both.<|tool_call_start|>[get_weather(city="Paris \\"Centre\\"", days=3, '
    "units=['c', \"f\"], opts={'deep': True, \"none\": null}, ratio=-1.5e2), "
    "get_time(tz='Europe/Paris', dst=False, note='it\\'s \\u00e9')]<|tool_call_end|>"
)
WEATHER = weather_schema(flags={"type": "array", "items": {"type": "boolean"}, "maxItems": 2})


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    msg = read_whole(LFM2.stream([]), text)
    return msg.content, msg.calls


def test_python_and_json_literals() -> None:
    msg = read_whole(LFM2.stream([]), TEXT)
    assert msg.content == "Checking both."
    assert named_arguments(msg) == [
        (
            "get_weather",
            {
                "city": 'Paris "Centre"',
                "days": 3,
                "units": ["c", "f"],
                "opts": {"deep": True, "none": None},
                "ratio": -150.0,
            },
        ),
        ("get_time", {"tz": "Europe/Paris", "dst": False, "note": "it's é"}),
    ]


def test_a_json_string_keeps_json_escapes() -> None:
    _, calls = parse('<|tool_call_start|>[f(a="x\\/y\\ud83d\\ude00", b=())]<|tool_call_end|>')
    assert json.loads(calls[0].arguments) == {"a": "x/y😀", "b": []}


def test_empty_calls_and_a_bare_call() -> None:
    assert [c.arguments for c in parse("<|tool_call_start|>[ping()]<|tool_call_end|>")[1]] == ["{}"]
    assert [c.name for c in parse("<|tool_call_start|>ping(a=1,)<|tool_call_end|>")[1]] == ["ping"]


@pytest.mark.parametrize(
    "block",
    [
        "<|tool_call_start|>[]<|tool_call_end|>",
        "<|tool_call_start|>[f(1)]<|tool_call_end|>",  # positional
        "<|tool_call_start|>[f(a=b)]<|tool_call_end|>",  # a name, not a literal
        "<|tool_call_start|>[f(a=1)] and more<|tool_call_end|>",
        "<|tool_call_start|>[f(a='open)]<|tool_call_end|>",
        "<|tool_call_start|>[f(a=1e999)]<|tool_call_end|>",  # not a number JSON can hold
        "<|tool_call_start|>[f(a=" + "9" * 5000 + ")]<|tool_call_end|>",
        "<|tool_call_start|>[f(a=" + "[" * 1000 + "]" * 1000 + ")]<|tool_call_end|>",
        "<|tool_call_start|>[f(a={1: 2})]<|tool_call_end|>",
        '<|tool_call_start|>{"name": "f", "arguments": {}}<|tool_call_end|>',
        "<|tool_call_start|>[f(a=1)",  # never closed, and not a call either
    ],
)
def test_malformed_blocks_stay_content(block: str) -> None:
    assert parse("x " + block) == ("x " + block, [])


def test_random_chunkings_give_the_whole_result() -> None:
    assert_chunkings_read_as_whole(lambda: LFM2.stream([]), TEXT, seed=3)


def test_grammar_is_the_python_call_list(accepts: Accepts) -> None:
    grammar = LFM2.grammar([("get_weather", WEATHER), ("ping", {})])
    start, end = "<|tool_call_start|>[", ")]<|tool_call_end|>"
    assert accepts(grammar, start + 'get_weather(city="Paris", unit="celsius"' + end)
    assert accepts(grammar, start + 'get_weather(city="Rome", unit="fahrenheit", days=3, flags=[true]' + end)
    assert accepts(grammar, start + 'get_weather(city="Rome", unit="celsius", flags=[]' + end)
    assert accepts(grammar, start + "ping(" + end)
    assert not accepts(grammar, start + 'get_weather(unit="celsius", city="Paris"' + end)  # out of order
    assert not accepts(grammar, start + 'get_weather(city="Paris"' + end)  # unit is required
    assert not accepts(grammar, start + 'get_weather(city="Paris", unit="celsius", days="3"' + end)
    assert not accepts(grammar, start + "other(" + end)


def test_generated_calls_parse_into_the_forced_call(generate: Generate, format_engine: native.Engine) -> None:
    grammar = LFM2.grammar([("get_weather", WEATHER)])
    for seed in range(4):
        out = generate(grammar, seed)
        # The tags are CONTROL tokens (as in Liquid's GGUFs): the core's text leaves them out, the
        # engine renders them for its parser (generation.preserved); here the tokens are rendered so.
        text = format_engine.detokenize(out.tokens, False, True)
        assert out.stop_reason == "eos", text
        content, calls = parse(text)
        assert content is None and [c.name for c in calls] == ["get_weather"], text
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER)


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("get weather", {}, "function name"),
        ("f", {"type": "object", "properties": {"a-b c": {"type": "string"}}}, "parameter name"),
        ("f", {"type": "string"}, "must be an object schema"),
    ],
)
def test_schemas_the_format_cannot_force_are_refused(name: str, params: Any, message: str) -> None:
    with pytest.raises(BadRequest) as exc:
        LFM2.grammar([(name, params)])
    assert message in exc.value.message

"""engine_pool/server/tool_calls.py: `<tool_call>` blocks into OpenAI tool calls, whole and streamed."""

from __future__ import annotations

import json

from engine_pool.server.tool_calls import ToolCall, ToolCallStream, parse_tool_calls

TEXT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"utc\\"}"}\n</tool_call>'
)


def test_parse_content_and_calls() -> None:
    content, calls = parse_tool_calls(TEXT)
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert json.loads(calls[1].arguments) == {"tz": "utc"}
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")


def test_only_calls_means_no_content() -> None:
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n')
    assert content is None and calls[0].arguments == "{}"


def test_a_block_that_is_not_a_call_stays_in_the_content() -> None:
    text = "a <tool_call>not json</tool_call> b"
    assert parse_tool_calls(text) == (text, [])
    assert parse_tool_calls('x <tool_call>{"name": "f"') == ('x <tool_call>{"name": "f"', [])


def test_plain_text_is_untouched() -> None:
    assert parse_tool_calls("  hello <tool  ") == ("  hello <tool  ", [])


def test_streaming_in_tiny_pieces_gives_the_same_result() -> None:
    stream = ToolCallStream()
    parts: list[str | ToolCall] = []
    for ch in TEXT:
        parts += stream.feed(ch)
    parts += stream.finish()
    content = "".join(p for p in parts if isinstance(p, str))
    calls = [p for p in parts if isinstance(p, ToolCall)]
    assert content.strip() == "Let me check."
    assert "<" not in content
    assert [c.name for c in calls] == ["get_weather", "get_time"]


def test_streaming_releases_content_before_the_tag_is_complete() -> None:
    stream = ToolCallStream()
    assert stream.feed("Hi <tool") == ["Hi "]
    assert stream.feed("box>") == ["<toolbox>"]

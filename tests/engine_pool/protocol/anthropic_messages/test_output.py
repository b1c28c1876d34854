"""Anthropic Message objects from chat completions, judged by the anthropic SDK's own `Message` model."""

from __future__ import annotations

from typing import Any

import pytest
from anthropic.types import Message

from engine_pool.protocol import anthropic_messages as api

from ..conftest import completion

TOOL = {"name": "f", "input_schema": {"type": "object"}}


def request(**fields: Any) -> api.MessagesRequest:
    data = {"model": "claude-x", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}], **fields}
    return api.parse_request(data, max_messages=8)


def message(chat: dict[str, Any], **fields: Any) -> Message:
    return Message.model_validate(api.message_object(request(**fields), chat, message_id="msg_1"))


def test_a_text_completion() -> None:
    m = message(completion("Hello!", prompt=40, completion_tokens=3, cached=32))
    assert (m.id, m.type, m.role, m.model, m.stop_reason, m.stop_sequence) == (
        "msg_1",
        "message",
        "assistant",
        "claude-x",
        "end_turn",
        None,
    )
    assert [(b.type, getattr(b, "text", None)) for b in m.content] == [("text", "Hello!")]
    u = m.usage
    assert (u.input_tokens, u.output_tokens, u.cache_read_input_tokens, u.cache_creation_input_tokens) == (
        8,
        3,
        32,
        0,
    )


def test_thinking_text_and_tool_use_blocks() -> None:
    chat = completion(
        "Let me check.", reasoning="Call f.", calls=[("call_ab12", "f", '{"city": "Paris", "n": 2}')]
    )
    m = message(chat, tools=[TOOL])
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    thinking, _, use = m.content
    assert thinking.type == "thinking" and (thinking.thinking, thinking.signature) == ("Call f.", "")
    assert use.type == "tool_use" and (use.id, use.name, use.input) == (
        "toolu_ab12",
        "f",
        {"city": "Paris", "n": 2},
    )
    assert m.stop_reason == "tool_use"


def test_disable_parallel_tool_use_keeps_the_first_call() -> None:
    chat = completion(None, calls=[("call_1", "f", "{}"), ("call_2", "f", "{}")])
    m = message(chat, tools=[TOOL], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert [getattr(b, "id", None) for b in m.content] == ["toolu_1"]


def test_arguments_that_are_not_an_object_are_kept_whole() -> None:
    m = message(completion(None, calls=[("call_1", "f", "[1, 2")]), tools=[TOOL])
    assert m.content[0].type == "tool_use" and m.content[0].input == {"_raw_arguments": "[1, 2"}


@pytest.mark.parametrize(
    ("finish", "word", "reason", "sequence"),
    [
        ("length", "", "max_tokens", None),
        ("stop", "END", "stop_sequence", "END"),
        ("stop", "", "end_turn", None),
    ],
)
def test_stop_reasons(finish: str, word: str, reason: str, sequence: str | None) -> None:
    m = message(completion("text", finish=finish, stopping_word=word), stop_sequences=["END"])
    assert (m.stop_reason, m.stop_sequence) == (reason, sequence)


@pytest.mark.parametrize(
    ("report", "previous", "reason"),
    [
        (
            {"prefix": {"tokens": 90, "prompt_tokens": 80, "common": 10}, "diverged": {"part": "system"}},
            "msg_0",
            {"type": "system_changed", "cache_missed_input_tokens": 70},
        ),
        (
            {"prefix": {"tokens": 90, "prompt_tokens": 80, "common": 30}, "diverged": {"part": "tools"}},
            "msg_0",
            {"type": "tools_changed", "cache_missed_input_tokens": 70},
        ),
        (
            {
                "prefix": {"tokens": 90, "prompt_tokens": 80, "common": 50},
                "diverged": {"part": "message", "message": 2, "role": "user"},
            },
            "msg_0",
            {"type": "messages_changed", "cache_missed_input_tokens": 70},
        ),
        (
            {"prefix": {"tokens": 90, "prompt_tokens": 80, "common": 78}, "diverged": {"part": "reply"}},
            "msg_0",
            None,
        ),
        ({"served": "cold"}, "msg_0", {"type": "previous_message_not_found"}),
        (
            {"prefix": {"tokens": 90, "prompt_tokens": 80, "common": 10}, "diverged": {"part": "system"}},
            None,
            None,
        ),
    ],
)
def test_cache_diagnostics_from_the_engines_report(
    report: dict[str, Any], previous: Any, reason: Any
) -> None:
    chat = {**completion("ok", prompt=100, cached=10), "slotkeeper": report}
    m = message(chat, diagnostics={"previous_message_id": previous})
    assert m.diagnostics is not None
    got = m.diagnostics.cache_miss_reason
    assert (None if got is None else got.model_dump(exclude_none=True)) == reason
    assert (m.model_extra or {})["slotkeeper"] == report
    assert message(chat).diagnostics is None  # not asked for: not answered

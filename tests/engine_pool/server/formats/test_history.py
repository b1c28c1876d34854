"""formats/history.py and the format table: past turns as templates expect them; which format a
template gets under --chat-format auto and by name."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from engine_pool.body import Body
from engine_pool.errors import BadRequest, ServerError
from engine_pool.server.chat_request import parse_messages
from engine_pool.server.formats import prepare_history, select_format
from engine_pool.server.limits import RequestLimits
from native.model_gen import TEMPLATES, chat_template


def assistant(arguments: Any) -> dict[str, Any]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"role": "assistant", "content": None, "reasoning_content": "why", "tool_calls": [call]}


def test_json_object_arguments_become_mappings_and_nothing_else_changes() -> None:
    messages = [
        {"role": "user", "content": "hi", "tool_calls": [{"function": {"name": "x", "arguments": "{}"}}]},
        assistant('{"city": "Paris", "n": [1]}'),
        assistant("not json"),
        assistant("[1, 2]"),
        assistant('{"x": NaN}'),
        assistant({"already": "a mapping"}),
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    ]
    before = copy.deepcopy(messages)
    out = prepare_history(messages)
    assert messages == before  # the caller's messages are left alone
    args = [m["tool_calls"][0]["function"]["arguments"] for m in out[1:6]]
    assert args == [{"city": "Paris", "n": [1]}, "not json", "[1, 2]", '{"x": NaN}', {"already": "a mapping"}]
    assert out[1]["reasoning_content"] == "why" and out[1]["tool_calls"][0]["id"] == "c1"
    assert out[0] == messages[0] and out[6] == messages[6]  # only assistants' calls are touched


def test_history_reasoning_must_be_text_for_the_template() -> None:
    def messages(reasoning: Any) -> Body:
        return Body({"messages": [{"role": "assistant", "content": "x", "reasoning_content": reasoning}]})

    assert parse_messages(messages("why"), RequestLimits())[0]["reasoning_content"] == "why"
    assert parse_messages(messages(None), RequestLimits())[0]["reasoning_content"] is None
    with pytest.raises(BadRequest) as exc:
        parse_messages(messages({"a": 1}), RequestLimits())
    assert exc.value.param == "messages[0].reasoning_content"


FAMILY = {
    "hermes": "hermes",
    "granite": "hermes",
    "qwen35": "qwen-xml",
    "nemotron": "qwen-xml",
    "lfm2": "lfm2",
}


def test_auto_detects_the_family_from_the_template() -> None:
    assert set(FAMILY) == set(TEMPLATES)
    for template, family in FAMILY.items():
        assert select_format("auto", chat_template(template)).name == family, template


def test_a_named_format_wins_and_an_unknown_name_is_an_error() -> None:
    assert select_format("lfm2", chat_template("hermes")).name == "lfm2"
    assert select_format("auto", "").name == "hermes"
    with pytest.raises(ServerError) as exc:
        select_format("mistral", "")
    assert "auto, qwen-xml, lfm2, hermes" in exc.value.message

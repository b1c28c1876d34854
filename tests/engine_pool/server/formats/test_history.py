"""formats/history.py and the format table: conversations in the one shape templates get; which format a
template gets under --chat-format auto and by name."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from engine_pool.errors import BadRequest, ServerError
from engine_pool.http.body import Body
from engine_pool.server.chat_request import parse_messages
from engine_pool.server.formats import select_format
from engine_pool.server.formats.history import normalise
from engine_pool.server.limits import RequestLimits
from engine_pool.server.template_caps import TemplateCaps
from native.model_gen import TEMPLATES, chat_template


def assistant(arguments: Any) -> dict[str, Any]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"role": "assistant", "content": None, "reasoning_content": "why", "tool_calls": [call]}


OBJECTS = TemplateCaps(object_arguments=True)


def test_arguments_become_mappings_for_a_template_that_iterates_them_and_nothing_else_changes() -> None:
    messages = [
        {"role": "user", "content": "hi"},
        assistant('{"city": "Paris", "n": [1]}'),
        assistant("not json"),
        assistant("[1, 2]"),
        assistant('{"x": NaN}'),
        assistant({"already": "a mapping"}),
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    ]
    before = copy.deepcopy(messages)
    out = normalise(messages, None, OBJECTS)
    assert messages == before  # the caller's messages are left alone
    args = [m["tool_calls"][0]["function"]["arguments"] for m in out[1:6]]
    assert args == [{"city": "Paris", "n": [1]}, "not json", "[1, 2]", '{"x": NaN}', {"already": "a mapping"}]
    assert out[1]["reasoning_content"] == "why" and out[1]["tool_calls"][0]["id"] == "c1"
    assert out[1]["content"] == ""  # a tool-call turn without content gets "" (llama.cpp's shape)
    assert out[0] == messages[0] and out[6] == messages[6]


def test_a_template_that_writes_text_gets_the_clients_text_and_mappings_as_json() -> None:
    out = normalise([assistant('{"city":"Paris"}'), assistant({"city": "Paris"})], None, TemplateCaps())
    assert [m["tool_calls"][0]["function"]["arguments"] for m in out] == [
        '{"city":"Paris"}',
        '{"city": "Paris"}',
    ]


def test_one_shape_for_every_message() -> None:
    messages: list[Any] = [
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "q", "extra": 1, "reasoning_content": ""},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
    ]
    out = normalise(messages, None, TemplateCaps())
    assert out == [
        {"role": "system", "content": "a\nb"},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
    ]
    typed = normalise(messages[:2], None, TemplateCaps(string_content=False, typed_content=True))
    assert typed[1]["content"] == [{"type": "text", "text": "q"}]
    assert typed[0]["content"] == messages[0]["content"]


def test_what_a_template_cannot_write_is_written_for_it() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    messages: list[Any] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "r1"},
        {"role": "tool", "tool_call_id": "c2", "content": "r2"},
        {"role": "user", "content": "and?"},
    ]
    bare = TemplateCaps(system_role=False, tools=False, tool_calls=False, tool_results=False)
    out = normalise(messages, [tool], bare)
    assert [m["role"] for m in out] == ["user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\nYou may call one or more functions")
    assert json.dumps(tool) in out[0]["content"] and out[0]["content"].endswith("\nq")
    assert out[1] == {
        "role": "assistant",
        "content": 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
    }
    assert (
        out[2]["content"]
        == "<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n</tool_response>\nand?"
    )
    alone = normalise([{"role": "system", "content": "only"}], None, bare)
    assert alone == [{"role": "user", "content": "only"}]  # never dropped


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
    assert "auto, qwen-xml, lfm2, nemotron-h, hermes" in exc.value.message

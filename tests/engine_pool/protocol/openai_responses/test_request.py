"""Responses requests: parsing, items as chat messages, the chat body, the input item listing, and a
precise 400 for every malformed field."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.responses import ResponseItemList

from engine_pool.errors import BadRequest
from engine_pool.protocol import openai_responses as api

from ..conftest import weather_lookup

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}
CONVERSATION: list[dict[str, Any]] = [
    {"role": "developer", "content": "Be brief."},
    {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
    },
    {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "sum"}]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
    {"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    {"type": "function_call", "call_id": "call_b", "name": "get_weather", "arguments": '{"city": "Rome"}'},
    {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
    {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "rain"}]},
    {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "both known"}]},
    {"role": "assistant", "content": "Sunny and rain."},
    {"role": "user", "content": "Thanks"},
]


def parse(data: dict[str, Any], max_items: int = 64) -> api.ResponsesRequest:
    return api.parse_request({"model": "m", **data}, max_items=max_items)


def test_a_string_input_is_one_user_message() -> None:
    req = parse({"input": "hi"})
    assert req.store and req.parallel_tool_calls and req.tool_choice == "auto" and not req.stream
    assert api.input_messages(req) == [{"role": "user", "content": "hi"}]
    [item] = api.input_item_list(req)
    assert item["id"].startswith("msg_") and item["content"] == [{"type": "input_text", "text": "hi"}]


def test_items_fold_into_chat_turns() -> None:
    req = parse({"input": CONVERSATION, "instructions": "not in the input"})
    assert api.input_messages(req) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        *weather_lookup(("call_a", "call_b"), "Let me look.", "sum", ("sunny", "rain")),
        {"role": "assistant", "content": "Sunny and rain.", "reasoning_content": "both known"},
        {"role": "user", "content": "Thanks"},
    ]


def test_items_out_of_turn_order_start_new_assistant_messages() -> None:
    items = [
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"role": "assistant", "content": "after the call"},
        {"role": "assistant", "content": "again"},
    ]
    messages = api.items_to_messages(parse({"input": items}).items)
    assert [(m["content"], len(m.get("tool_calls", []))) for m in messages] == [
        (None, 1),
        ("after the call", 0),
        ("again", 0),
    ]


def test_the_input_item_listing_parses_with_the_sdk() -> None:
    req = parse({"input": CONVERSATION})
    items = api.input_item_list(req)
    page = ResponseItemList.model_validate(
        {
            "object": "list",
            "data": items,
            "first_id": items[0]["id"],
            "last_id": items[-1]["id"],
            "has_more": False,
        }
    )
    assert [i.type for i in page.data] == [i.get("type", "message") for i in CONVERSATION]
    assert len({i["id"] for i in items}) == len(items) and items[2]["id"] == "rs_1"  # given ids are kept
    assert api.input_item_list(req) == items  # ids are fixed at parse time


def test_the_chat_body() -> None:
    req = parse(
        {
            "input": "hi",
            "instructions": "Be brief.",
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 50,
            "temperature": 0.5,
            "top_p": 0.9,
            "stream": True,
            "parallel_tool_calls": False,
            "text": {
                "format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}
            },
            "reasoning": {"effort": "none"},
            "seed": 7,
            "stop": ["\n"],
            "chat_template_kwargs": {"x": 1},
            "unknown_field": 1,
        }
    )
    history = [{"role": "user", "content": "before"}, {"role": "assistant", "content": "then"}]
    assert api.chat_body(req, history) == {
        "model": "m",
        "messages": [{"role": "system", "content": "Be brief."}, *history, {"role": "user", "content": "hi"}],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Weather in a city",
                    "parameters": WEATHER["parameters"],
                    "strict": True,
                },
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "max_tokens": 50,
        "temperature": 0.5,
        "top_p": 0.9,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True},
        },
        "seed": 7,
        "stop": ["\n"],
        "chat_template_kwargs": {"x": 1, "enable_thinking": False},
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_instructions_and_leading_developer_messages_are_one_system_prompt() -> None:
    items = [
        {"role": "developer", "content": "Sandbox: read-only."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "developer", "content": "later"},
    ]
    body = api.chat_body(parse({"input": items, "instructions": "You are a coding agent."}), [])
    assert body["messages"] == [
        {"role": "system", "content": "You are a coding agent.\n\nSandbox: read-only.\n\nBe brief."},
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "later"},
    ]


@pytest.mark.parametrize(
    ("choice", "chat"),
    [("auto", "auto"), ("none", "none"), ("required", "required")],
)
def test_tool_choice_strings(choice: str, chat: str) -> None:
    assert (
        api.chat_body(parse({"input": "x", "tools": [WEATHER], "tool_choice": choice}), [])["tool_choice"]
        == chat
    )


def test_json_object_format_and_no_tools() -> None:
    body = api.chat_body(parse({"input": "x", "text": {"format": {"type": "json_object"}}}), [])
    assert body["response_format"] == {"type": "json_object"} and "tools" not in body and "stream" not in body


def test_accepted_fields_are_kept() -> None:
    req = parse(
        {
            "input": "x",
            "store": False,
            "previous_response_id": "resp_1",
            "metadata": {"k": "v"},
            "reasoning": {"effort": "low", "summary": "auto"},
            "text": {"verbosity": "low"},
            "user": "u",
            "prompt_cache_key": "pck",
            "include": ["reasoning.encrypted_content"],
            "truncation": "disabled",
        }
    )
    assert (req.store, req.previous_response_id, req.metadata, req.user, req.prompt_cache_key) == (
        False,
        "resp_1",
        {"k": "v"},
        "u",
        "pck",
    )
    assert req.reasoning == {"effort": "low", "summary": "auto"} and req.verbosity == "low"


def test_model_is_optional_as_in_llama_server() -> None:
    """An engine serves one model (llama-server's test_responses_stream_with_llama_telemetry sends
    none); the gateway, which picks a model by name, still requires it (tests/gateway)."""
    req = api.parse_request({"input": "x"}, max_items=4)
    assert req.model == ""


BAD: list[tuple[dict[str, Any], str, str]] = [
    ({}, "input", "'input' is required"),
    ({"input": 5}, "input", "must be a string or an array of items, got integer"),
    ({"input": []}, "input", "must not be an empty array"),
    ({"input": ["x"]}, "input[0]", "must be an object, got string"),
    ({"input": [{"type": "computer_call"}]}, "input[0]", "item type 'computer_call' is not supported"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "item_reference is not supported"),
    ({"input": [{"content": "x"}]}, "input[0]", "input item type None"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "must be one of user, system"),
    (
        {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "a"},
                        {"type": "input_image", "image_url": "u"},
                    ],
                }
            ]
        },
        "input[0].content[1]",
        "content part type 'input_image' is not supported by this server (text only)",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
        "input[0].content[0]",
        "'input_file'",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]},
        "input[0].content[0]",
        "unknown content part type 'text'",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]},
        "input[0].content[0]",
        "'input[0].content[0].text' must be a string",
    ),
    (
        {"input": [{"role": "user", "content": 5}]},
        "input[0].content",
        "must be a string or an array of content parts",
    ),
    (
        {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
        "input[0].call_id",
        "non-empty string",
    ),
    (
        {"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]},
        "input[0].name",
        "non-empty string",
    ),
    (
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
        "input[0].arguments",
        "must be a string",
    ),
    (
        {"input": [{"type": "function_call_output", "call_id": "c"}]},
        "input[0].output",
        "'input[0].output' is required",
    ),
    (
        {"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]},
        "input[0].output[0]",
        "'input_image' is not supported",
    ),
    ({"input": [{"type": "reasoning", "summary": [{"type": "x"}]}]}, "input[0].summary[0]", "summary_text"),
    ({"input": [{"role": "user", "content": "x", "id": 5}]}, "input[0].id", "must be a string"),
    ({"input": "x", "instructions": 5}, "instructions", "must be a string"),
    ({"input": "x", "tools": [{"type": "browser"}]}, "tools[0]", "unknown tool type 'browser'"),
    (
        {"input": "x", "tools": [{"type": "function", "function": {"name": "f"}}]},
        "tools[0]",
        "Chat Completions shape",
    ),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name", "non-empty string"),
    ({"input": "x", "tools": [WEATHER, WEATHER]}, "tools[1].name", "tool names must be unique"),
    (
        {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": []}]},
        "tools[0].parameters",
        "an object",
    ),
    (
        {"input": "x", "tools": [{"type": "function", "name": "f", "strict": "yes"}]},
        "tools[0].strict",
        "a boolean",
    ),
    ({"input": "x", "tool_choice": "sometimes"}, "tool_choice", "must be auto, none, required or a function"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "no 'tools' were given"),
    (
        {"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
        "tool_choice",
        "'nope'",
    ),
    (
        {"input": "x", "tools": [WEATHER], "tool_choice": {"type": "allowed_tools"}},
        "tool_choice",
        "'allowed_tools' is not supported",
    ),
    ({"input": "x", "tool_choice": 5}, "tool_choice", "a string or an object"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "must be >= 1"),
    ({"input": "x", "max_output_tokens": "8"}, "max_output_tokens", "must be an integer, got string"),
    ({"input": "x", "temperature": 3}, "temperature", "within 0.0..2.0"),
    ({"input": "x", "top_p": 1.5}, "top_p", "within 0.0..1.0"),
    ({"input": "x", "stream": "yes"}, "stream", "a boolean"),
    ({"input": "x", "store": 1}, "store", "a boolean"),
    ({"input": "x", "parallel_tool_calls": "no"}, "parallel_tool_calls", "a boolean"),
    ({"input": "x", "previous_response_id": ""}, "previous_response_id", "must not be empty"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata.k", "a string of at most 512"),
    ({"input": "x", "metadata": {"k" * 65: "v"}}, "metadata", "at most 64 characters"),
    (
        {"input": "x", "text": {"format": {"type": "xml"}}},
        "text.format.type",
        "one of text, json_object, json_schema",
    ),
    (
        {"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}},
        "text.format.name",
        "is required",
    ),
    (
        {"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": 1}}},
        "text.format.schema",
        "a JSON schema object",
    ),
    ({"input": "x", "text": {"verbosity": "loud"}}, "text.verbosity", "one of low, medium, high"),
    ({"input": "x", "reasoning": {"effort": "huge"}}, "reasoning.effort", "one of none, minimal"),
    ({"input": "x", "truncation": "auto"}, "truncation", "never drops input items"),
    ({"input": "x", "truncation": "x"}, "truncation", "one of disabled, auto"),
    (
        {"input": "x", "include": ["message.output_text.logprobs"]},
        "include[0]",
        "not supported by this server",
    ),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "chain responses with 'previous_response_id'"),
    ({"input": "x", "prompt": {"id": "p"}}, "prompt", "not supported"),
    ({"input": "x", "max_tool_calls": 2}, "max_tool_calls", "not supported"),
    ({"input": "x", "background": True}, "background", "not supported"),
    ({"input": "x", "top_logprobs": 2}, "top_logprobs", "not supported"),
]


@pytest.mark.parametrize(("data", "param", "message"), BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_malformed_fields_are_400s_naming_them(data: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(BadRequest) as exc:
        parse(data)
    assert exc.value.status == 400 and exc.value.type == "invalid_request_error"
    assert exc.value.param == param
    assert message in exc.value.message


def test_items_and_parts_are_bounded() -> None:
    with pytest.raises(BadRequest) as exc:
        parse({"input": [{"role": "user", "content": "x"}] * 3}, max_items=2)
    assert (exc.value.param, exc.value.extra) == ("input", {"limit": 2})
    with pytest.raises(BadRequest) as exc:
        parse(
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}] * 3}]}, max_items=2
        )
    assert exc.value.param == "input[0].content"

"""Anthropic Messages requests: parsing, the conversation as chat messages, the chat body, and a
precise 400 for every malformed field."""

from __future__ import annotations

from typing import Any

import pytest

from engine_pool.errors import BadRequest
from engine_pool.protocol import anthropic_messages as api

from ..conftest import tool_call, weather_lookup

WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "cache_control": {"type": "ephemeral"},
}
USER = [{"role": "user", "content": "hi"}]


def parse(data: dict[str, Any], max_messages: int = 32) -> api.MessagesRequest:
    return api.parse_request({"model": "claude", "max_tokens": 64, **data}, max_messages=max_messages)


def test_the_conversation_as_chat_messages() -> None:
    req = parse(
        {
            "system": [
                {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Really."},
            ],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "Use the tool.", "signature": "sig"},
                        {"type": "redacted_thinking", "data": "opaque"},
                        {"type": "text", "text": "Checking."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "get_weather",
                            "input": {"city": "Paris"},
                        },
                        {
                            "type": "tool_use",
                            "id": "toolu_2",
                            "name": "get_weather",
                            "input": {"city": "Rome"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": "sunny",
                            "cache_control": {"type": "ephemeral"},
                        },
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_2",
                            "content": [{"type": "text", "text": "down"}],
                            "is_error": True,
                        },
                        {"type": "text", "text": "And tomorrow?"},
                    ],
                },
            ],
        }
    )
    assert req.system == "Be brief.\nReally."
    assert list(req.messages) == [
        {"role": "user", "content": "Weather in Paris?"},
        *weather_lookup(("toolu_1", "toolu_2"), "Checking.", "Use the tool.", ("sunny", "Error: down")),
        {"role": "user", "content": "And tomorrow?"},
    ]


def test_a_mid_conversation_system_message_stays_where_it_sits() -> None:
    """Claude Code (2.1.197, on Opus 4.8 and newer names) sends its agent and skill listings as a
    `system` message after the first user message, and the conversation may end there."""
    listing = [{"type": "text", "text": "Agents: Explore."}, {"type": "text", "text": "Skills: init."}]
    req = parse({"system": "Be brief.", "messages": [*USER, {"role": "system", "content": listing}]})
    assert list(req.messages) == [*USER, {"role": "system", "content": "Agents: Explore.\nSkills: init."}]
    assert api.chat_body(req)["messages"] == [{"role": "system", "content": "Be brief."}, *req.messages]
    later = parse({"messages": [*USER, {"role": "system", "content": "Later."}, *USER]})
    assert list(later.messages) == [*USER, {"role": "system", "content": "Later."}, *USER]


def test_tool_results_alone_make_no_empty_user_message() -> None:
    req = parse(
        {
            "messages": [
                *USER,
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
            ]
        }
    )
    assert list(req.messages)[1:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [tool_call("t", "f", "{}")],
        },
        {"role": "tool", "tool_call_id": "t", "content": ""},
    ]


def test_the_chat_body() -> None:
    req = parse(
        {
            "max_tokens": 2048,
            "system": "sys",
            "messages": USER,
            "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            "stop_sequences": ["END", "\n\n"],
            "temperature": 0.0,
            "top_p": 0.9,
            "top_k": 5,
            "stream": True,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "metadata": {"user_id": "u"},
            "seed": 3,
            "stop": ["ignored: Messages has stop_sequences"],
        },
        max_messages=8,
    )
    assert req.parallel_tool_calls is False and req.metadata == {"user_id": "u"}
    assert api.chat_body(req) == {
        "model": "claude",
        "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}],
        "max_tokens": 2048,
        "seed": 3,
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "parameters": WEATHER["input_schema"],
                    "description": "Weather in a city",
                },
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "stop": ["END", "\n\n"],
        "temperature": 0.0,
        "top_p": 0.9,
        "top_k": 5,
        "chat_template_kwargs": {"enable_thinking": True},
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@pytest.mark.parametrize(
    ("choice", "chat"),
    [({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none")],
)
def test_tool_choices(choice: dict[str, Any], chat: str) -> None:
    req = parse({"messages": USER, "tools": [WEATHER], "tool_choice": choice})
    assert api.chat_body(req)["tool_choice"] == chat and req.parallel_tool_calls


@pytest.mark.parametrize(
    ("thinking", "enabled"), [({"type": "disabled"}, False), ({"type": "adaptive"}, None)]
)
def test_thinking_switches_the_template(thinking: dict[str, Any], enabled: bool | None) -> None:
    body = api.chat_body(parse({"messages": USER, "thinking": thinking}))
    assert body.get("chat_template_kwargs", {}).get("enable_thinking") is enabled


def test_structured_output_and_count_requests() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = api.chat_body(
        parse({"messages": USER, "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    )
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }
    count = api.parse_count_request({"model": "m", "messages": USER, "tools": [WEATHER]}, max_messages=4)
    body = api.chat_body(count)
    assert (
        "max_tokens" not in body
        and "stream" not in body
        and body["tools"][0]["function"]["name"] == "get_weather"
    )


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"model": None, "messages": USER}, "model", "'model' is required"),
    ({"max_tokens": None, "messages": USER}, "max_tokens", "'max_tokens' is required"),
    ({"max_tokens": 0, "messages": USER}, "max_tokens", "must be >= 1"),
    ({}, "messages", "'messages' is required"),
    ({"messages": ["hi"]}, "messages[0]", "must be an object, got string"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "user, assistant or system"),
    (
        {"messages": [*USER, {"role": "system", "content": [{"type": "tool_use"}]}]},
        "messages[1].content[0]",
        "'tool_use'",
    ),
    (
        {"messages": [{"role": "user", "content": 5}]},
        "messages[0].content",
        "string or an array of content blocks",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, IMAGE]}]},
        "messages[0].content[1]",
        "image input is not supported",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
        "messages[0].content[0]",
        "'document'",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}
            ]
        },
        "messages[0].content[0]",
        "does not belong",
    ),
    (
        {
            "messages": [
                *USER,
                {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
                *USER,
            ]
        },
        "messages[1].content[0]",
        "does not belong",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        "messages[0].content[0].text",
        "must be a string",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
        "messages[0].content[0].tool_use_id",
        "non-empty string",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [IMAGE]}]}
            ]
        },
        "messages[0].content[0].content[0]",
        "image input is not supported",
    ),
    (
        {
            "messages": [
                *USER,
                {"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]},
                *USER,
            ]
        },
        "messages[1].content[0]",
        "non-empty 'id' and 'name'",
    ),
    (
        {
            "messages": [
                *USER,
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": []}]},
                *USER,
            ]
        },
        "messages[1].content[0].input",
        "an object",
    ),
    (
        {"messages": [*USER, {"role": "assistant", "content": [{"type": "server_tool_use"}]}, *USER]},
        "messages[1].content[0]",
        "'server_tool_use' is not supported",
    ),
    ({"messages": [*USER, {"role": "assistant", "content": "The answer is ("}]}, "messages[1]", "prefill"),
    ({"messages": USER, "system": [IMAGE]}, "system[0]", "image input is not supported"),
    ({"messages": USER, "system": 5}, "system", "string or an array of text blocks"),
    (
        {"messages": USER, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        "tools[0]",
        "'web_search_20250305' is a server tool",
    ),
    ({"messages": USER, "tools": [{"name": "f"}]}, "tools[0].input_schema", "is required"),
    ({"messages": USER, "tools": [{"input_schema": {}}]}, "tools[0].name", "non-empty string"),
    ({"messages": USER, "tools": [WEATHER, WEATHER]}, "tools[1].name", "defined twice"),
    (
        {"messages": USER, "tool_choice": {"type": "sometimes"}},
        "tool_choice.type",
        "one of auto, any, tool, none",
    ),
    ({"messages": USER, "tool_choice": {"type": "any"}}, "tool_choice", "no 'tools' were given"),
    (
        {"messages": USER, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
        "tool_choice.name",
        "'nope'",
    ),
    (
        {
            "messages": USER,
            "tools": [WEATHER],
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": "y"},
        },
        "tool_choice.disable_parallel_tool_use",
        "a boolean",
    ),
    ({"messages": USER, "stop_sequences": ["ok", ""]}, "stop_sequences[1]", "non-empty string"),
    ({"messages": USER, "stop_sequences": "END"}, "stop_sequences", "an array"),
    ({"messages": USER, "temperature": 1.5}, "temperature", "within 0.0..1.0"),
    ({"messages": USER, "top_k": -1}, "top_k", ">= 0"),
    ({"messages": USER, "thinking": {"type": "enabled"}}, "thinking", "budget_tokens' is required"),
    (
        {"messages": USER, "thinking": {"type": "enabled", "budget_tokens": -1}},
        "thinking.budget_tokens",
        ">= 0",
    ),
    (
        {"messages": USER, "thinking": {"type": "enabled", "budget_tokens": 2048}},
        "thinking.budget_tokens",
        "less than 'max_tokens'",
    ),
    (
        {"messages": USER, "thinking": {"type": "sometimes"}},
        "thinking.type",
        "one of enabled, disabled, adaptive",
    ),
    (
        {"messages": USER, "output_config": {"format": {"type": "json_schema", "schema": 1}}},
        "output_config.format.schema",
        "JSON schema object",
    ),
    ({"messages": USER, "metadata": "u"}, "metadata", "an object"),
]


@pytest.mark.parametrize(("data", "param", "message"), BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_malformed_fields_are_400s_naming_them(data: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(BadRequest) as exc:
        parse(data)
    assert exc.value.status == 400 and exc.value.param == param
    assert message in exc.value.message


def test_llama_server_permissions_an_empty_conversation_and_a_small_thinking_budget() -> None:
    """llama-server's test_anthropic_empty_messages and test_anthropic_thinking: both are accepted."""
    empty = parse({"messages": [], "system": "Be brief."})
    assert empty.messages == () and api.chat_body(empty)["messages"] == [
        {"role": "system", "content": "Be brief."}
    ]
    small = parse({"max_tokens": 100, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": 50}})
    assert small.thinking is True
    assert api.chat_body(small)["chat_template_kwargs"] == {"enable_thinking": True}


def test_messages_and_blocks_are_bounded() -> None:
    with pytest.raises(BadRequest) as exc:
        parse({"messages": USER * 3}, max_messages=2)
    assert (exc.value.param, exc.value.extra) == ("messages", {"limit": 2})
    with pytest.raises(BadRequest) as exc:
        parse(
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 3}]}, max_messages=2
        )
    assert exc.value.param == "messages[0].content"


EPHEMERAL = {"type": "ephemeral"}


def test_cache_breakpoints_as_anthropic_bounds_them() -> None:
    marked = {"type": "text", "text": "x", "cache_control": EPHEMERAL}
    four = {
        "system": [marked, marked],
        "tools": [WEATHER],
        "cache_control": EPHEMERAL,
        "messages": [
            {"role": "user", "content": [{**marked, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}
        ],
    }
    assert parse(four).system == "x\nx"  # four blocks, and the top-level marker (automatic caching)
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [marked]}
    five = {**four, "messages": [{"role": "user", "content": [result, marked]}]}
    with pytest.raises(BadRequest) as exc:
        parse(five)
    assert exc.value.message == "A maximum of 4 blocks with cache_control may be provided. Found 5."
    with pytest.raises(BadRequest) as exc:  # a thousand of them: the same precise refusal
        parse({"system": [marked] * 1000, "messages": USER}, max_messages=4096)
    assert exc.value.param == "cache_control" and "Found 1000" in exc.value.message


@pytest.mark.parametrize(
    ("marker", "param"),
    [
        ({"type": "persistent"}, "system[0].cache_control"),
        ({"type": "ephemeral", "ttl": "1d"}, "system[0].cache_control"),
        ("ephemeral", "system[0].cache_control"),
    ],
)
def test_a_malformed_cache_control_is_named(marker: Any, param: str) -> None:
    with pytest.raises(BadRequest) as exc:
        parse({"system": [{"type": "text", "text": "x", "cache_control": marker}], "messages": USER})
    assert exc.value.param == param
    with pytest.raises(BadRequest) as exc:
        parse({"cache_control": marker, "messages": USER})
    assert exc.value.param == "cache_control"


def test_cache_diagnostics_are_read() -> None:
    assert parse({"messages": USER}).diagnostics is False
    asked = parse({"messages": USER, "diagnostics": {"previous_message_id": None}})
    assert (asked.diagnostics, asked.previous_message_id) == (True, None)
    assert (
        parse({"messages": USER, "diagnostics": {"previous_message_id": "msg_1"}}).previous_message_id
        == "msg_1"
    )
    for bad in ({"previous_message_id": "m" * 129}, {"previous_message_id": 7}, []):
        with pytest.raises(BadRequest):
            parse({"messages": USER, "diagnostics": bad})

"""Response objects from chat completions, judged by the openai SDK's own `Response` model."""

from __future__ import annotations

from typing import Any

from openai.types.responses import Response, ToolChoiceFunction

from engine_pool.protocol import openai_responses as api

from ..conftest import completion

TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}


def respond(chat: dict[str, Any], **fields: Any) -> tuple[dict[str, Any], Response]:
    req = api.parse_request({"model": "client-model", "input": "hi", **fields}, max_items=16)
    obj = api.response_object(req, chat, response_id="resp_1", created_at=1700000000)
    return obj, Response.model_validate(obj)


def test_a_text_completion() -> None:
    obj, r = respond(completion("Hello!", prompt=40, completion_tokens=3, cached=32))
    assert (r.id, r.object, r.status, r.model, r.created_at) == (
        "resp_1",
        "response",
        "completed",
        "client-model",
        1700000000,
    )
    assert r.output_text == "Hello!" and r.incomplete_details is None and r.error is None
    [msg] = r.output
    assert msg.type == "message" and msg.id.startswith("msg_") and msg.status == "completed"
    assert r.usage is not None
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (40, 3, 43)
    assert r.usage.input_tokens_details.cached_tokens == 32
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert (r.parallel_tool_calls, r.truncation, r.tools, r.tool_choice) == (True, "disabled", [], "auto")
    assert (r.model_extra or {})["store"] is True  # echoed; this SDK keeps it as an extra field


def test_reasoning_content_and_calls_become_items_in_order() -> None:
    chat = completion(
        "Checking.",
        reasoning="I should call f twice.",
        calls=[("call_1", "f", '{"a": 1}'), ("call_2", "f", '{"a": 2}')],
        reasoning_tokens=6,
    )
    obj, r = respond(chat, tools=[TOOL], tool_choice="required")
    assert [i.type for i in r.output] == ["reasoning", "message", "function_call", "function_call"]
    reasoning, message, first, second = r.output
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert reasoning.content[0].text == "I should call f twice." and reasoning.id.startswith("rs_")
    assert first.type == "function_call" and second.type == "function_call"
    assert (first.call_id, first.name, first.arguments, first.status) == (
        "call_1",
        "f",
        '{"a": 1}',
        "completed",
    )
    assert second.call_id == "call_2" and first.id and first.id.startswith("fc_") and first.id != second.id
    assert r.status == "completed" and r.usage and r.usage.output_tokens_details.reasoning_tokens == 6
    assert r.tools[0].type == "function" and r.tool_choice == "required"
    # Back to chat: the same assistant turn, so a continuation renders what the engine generated.
    assert api.output_messages(obj) == [
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "I should call f twice.",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
                {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": '{"a": 2}'}},
            ],
        }
    ]


def test_only_calls_have_no_message_item() -> None:
    _, r = respond(completion(None, calls=[("call_1", "f", "{}")]), tools=[TOOL])
    assert [i.type for i in r.output] == ["function_call"] and r.output_text == ""


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    chat = completion(None, calls=[("call_1", "f", "{}"), ("call_2", "f", "{}")])
    _, r = respond(chat, tools=[TOOL], parallel_tool_calls=False)
    assert [getattr(i, "call_id", None) for i in r.output] == ["call_1"] and r.parallel_tool_calls is False


def test_the_token_limit_makes_it_incomplete() -> None:
    _, r = respond(completion("cut sh", reasoning="long thought", finish="length"), max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens" and r.max_output_tokens == 5
    assert [getattr(i, "status", None) for i in r.output] == ["completed", "incomplete"]  # the last was cut


def test_settings_are_echoed() -> None:
    fields = {
        "instructions": "Be brief.",
        "tools": [TOOL],
        "tool_choice": {"type": "function", "name": "f"},
        "temperature": 0.2,
        "top_p": 0.5,
        "max_output_tokens": 9,
        "previous_response_id": "resp_0",
        "store": False,
        "metadata": {"k": "v"},
        "text": {
            "format": {"type": "json_schema", "name": "o", "schema": {"type": "object"}},
            "verbosity": "low",
        },
        "reasoning": {"effort": "high"},
        "user": "u1",
        "prompt_cache_key": "key",
    }
    _, r = respond(completion("{}"), **fields)
    assert (r.instructions, r.temperature, r.top_p, r.max_output_tokens) == ("Be brief.", 0.2, 0.5, 9)
    assert (r.previous_response_id, r.metadata, r.user, r.prompt_cache_key) == (
        "resp_0",
        {"k": "v"},
        "u1",
        "key",
    )
    assert (r.model_extra or {})["store"] is False
    assert isinstance(r.tool_choice, ToolChoiceFunction) and r.tool_choice.name == "f"
    assert r.text is not None and r.text.format is not None and r.text.format.type == "json_schema"
    assert r.text.verbosity == "low" and r.reasoning is not None and r.reasoning.effort == "high"

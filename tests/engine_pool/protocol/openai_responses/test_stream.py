"""Responses event streams from chat chunks, validated event by event with the openai SDK's models and
accumulated by the SDK's own stream state machine (what `client.responses.stream` runs)."""

from __future__ import annotations

from typing import Any

import pytest
from openai import omit
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from engine_pool.errors import Unavailable
from engine_pool.protocol import openai_responses as api

from ..conftest import chunks_of, completion

EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}


def request(**fields: Any) -> api.ResponsesRequest:
    return api.parse_request({"model": "m", "input": "hi", "stream": True, **fields}, max_items=16)


def run(
    req: api.ResponsesRequest, chunks: list[dict[str, Any]]
) -> tuple[list[tuple[str, dict[str, Any]]], Any]:
    """The events for `chunks`, each validated; and what the SDK's state machine made of them."""
    stream = api.ResponseStream(req, response_id="resp_s", created_at=5)
    events = [e for c in chunks for e in stream.feed(c)] + stream.finish()
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    final = None
    for name, data in events:
        assert data["type"] == name
        for out in state.handle_event(EVENT.validate_python(data)):
            if out.type in ("response.completed", "response.incomplete", "response.failed"):
                final = out.response
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    return events, final


def test_a_text_stream_matches_the_response_object() -> None:
    chat = completion("Hello there!", prompt=30, completion_tokens=4, cached=25)
    req = request()
    events, final = run(req, chunks_of(chat))
    assert [n for n, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 4,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == []
    whole = Response.model_validate(api.response_object(req, chat, response_id="resp_s", created_at=5))
    assert final is not None and final.output_text == whole.output_text == "Hello there!"
    assert final.usage == whole.usage and final.status == whole.status == "completed"
    assert (
        final.id == "resp_s"
        and events[-1][1]["response"]["usage"]["input_tokens_details"]["cached_tokens"] == 25
    )


def test_reasoning_text_and_calls() -> None:
    chat = completion("ok", reasoning="hmm", calls=[("call_1", "f", '{"a": 1}'), ("call_2", "f", '{"b": 2}')])
    events, final = run(request(tools=[TOOL]), chunks_of(chat))
    names = [n for n, _ in events]
    assert names[2:8] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert names.count("response.function_call_arguments.done") == 2 and names[-1] == "response.completed"
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call", "function_call"]
    assert [(i.call_id, i.arguments) for i in final.output[2:]] == [
        ("call_1", '{"a": 1}'),
        ("call_2", '{"b": 2}'),
    ]
    added = [d["item"] for n, d in events if n == "response.output_item.added"]
    done = [d["item"] for n, d in events if n == "response.output_item.done"]
    assert [a["id"] for a in added] == [d["id"] for d in done] == [i.id for i in final.output]
    assert all(a["status"] == "in_progress" for a in added) and all(d["status"] == "completed" for d in done)


def test_arguments_streamed_in_fragments() -> None:
    req = request(tools=[TOOL])
    head = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    calls = [
        {"index": 0, "id": "call_x", "type": "function", "function": {"name": "f", "arguments": '{"a"'}},
        {"index": 0, "function": {"arguments": ": 1}"}},
    ]
    chunks = [{**head, "choices": [{"index": 0, "delta": {"tool_calls": [c]}}]} for c in calls]
    chunks.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    events, final = run(req, chunks)
    assert [d["delta"] for n, d in events if n == "response.function_call_arguments.delta"] == [
        '{"a"',
        ": 1}",
    ]
    assert final.output[0].arguments == '{"a": 1}'
    assert final.usage.total_tokens == 0  # no usage chunk: finish() completed it


def test_parallel_tool_calls_false_streams_one_call() -> None:
    chat = completion(None, calls=[("call_1", "f", "{}"), ("call_2", "f", "{}")])
    events, final = run(request(tools=[TOOL], parallel_tool_calls=False), chunks_of(chat))
    assert [i.call_id for i in final.output] == ["call_1"]
    assert sum(n == "response.output_item.added" for n, _ in events) == 1


def test_the_token_limit_ends_with_response_incomplete() -> None:
    events, final = run(request(max_output_tokens=3), chunks_of(completion("abcdefg", finish="length")))
    assert events[-1][0] == "response.incomplete"
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert [d["item"]["status"] for n, d in events if n == "response.output_item.done"] == ["incomplete"]


def test_the_final_response_is_kept_and_later_chunks_are_ignored() -> None:
    stream = api.ResponseStream(request(), response_id="resp_k", created_at=1)
    chunks = chunks_of(completion("x"))
    events = [e for c in chunks for e in stream.feed(c)]
    assert stream.response is not None and stream.response == events[-1][1]["response"]
    assert stream.feed(chunks[1]) == [] and stream.finish() == []


def test_a_failure_mid_stream_is_error_then_response_failed() -> None:
    stream = api.ResponseStream(request(), response_id="resp_f", created_at=1)
    chunks = chunks_of(completion("partial text"))
    events = [e for c in chunks[:3] for e in stream.feed(c)]
    events += stream.failed(Unavailable("the engine is shutting down", retry_after=1))
    names = [n for n, _ in events]
    assert names[-2:] == ["error", "response.failed"]
    error = EVENT.validate_python(events[-2][1])
    assert error.type == "error" and error.code == "unavailable" and "shutting down" in error.message
    failed = EVENT.validate_python(events[-1][1])
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert failed.response.error is not None and failed.response.error.code == "server_error"
    assert failed.response.output[0].type == "message" and failed.response.output[0].status == "in_progress"
    assert stream.feed(chunks[3]) == []


def test_a_failure_before_any_chunk_still_starts_the_response() -> None:
    stream = api.ResponseStream(request(), response_id="resp_f", created_at=1)
    names = [n for n, _ in stream.failed(Unavailable("no"))]
    assert names == ["response.created", "response.in_progress", "error", "response.failed"]


@pytest.mark.parametrize("status", [429, 500])
def test_failed_response_codes(status: int) -> None:
    from engine_pool.errors import for_status

    stream = api.ResponseStream(request(), response_id="r", created_at=1)
    failed = stream.failed(for_status(status)("x", status=status))[-1][1]
    code = "rate_limit_exceeded" if status == 429 else "server_error"
    assert EVENT.validate_python(failed).response.error.code == code  # type: ignore[union-attr]


NAMESPACE = {"type": "namespace", "name": "agents", "description": "Sub-agents.", "tools": [TOOL]}
CUSTOM = {
    "type": "custom",
    "name": "apply_patch",
    "format": {"type": "grammar", "syntax": "regex", "definition": "p+"},
}


def _seal(text: str) -> str:
    return "sealed:" + text[::-1]


def test_namespaced_and_custom_calls_stream_as_their_items() -> None:
    """A namespaced function's call streams with its namespace; a custom tool's as
    `custom_tool_call_input` delta and done once its call is complete; the SDK accumulates both."""
    chat = completion(
        None, calls=[("call_1", "agents.f", '{"a": 1}'), ("call_2", "apply_patch", '{"input": "ppp"}')]
    )
    events, final = run(request(tools=[NAMESPACE, CUSTOM]), chunks_of(chat))
    names = [n for n, _ in events]
    assert names.count("response.function_call_arguments.delta") == 1
    assert [d["delta"] for n, d in events if n == "response.custom_tool_call_input.delta"] == ["ppp"]
    assert [d["input"] for n, d in events if n == "response.custom_tool_call_input.done"] == ["ppp"]
    custom_added = next(
        d["item"] for n, d in events if n == "response.output_item.added" and d["output_index"] == 1
    )
    assert custom_added["type"] == "custom_tool_call" and custom_added["input"] == ""
    fn, custom = final.output
    assert (fn.type, fn.namespace, fn.name, fn.arguments) == ("function_call", "agents", "f", '{"a": 1}')
    assert (custom.type, custom.name, custom.input, custom.call_id) == (
        "custom_tool_call",
        "apply_patch",
        "ppp",
        "call_2",
    )
    req = request(tools=[NAMESPACE, CUSTOM])
    whole = api.response_object(req, chat, response_id="resp_s", created_at=5)
    assert [i.model_dump(exclude_none=True) for i in final.output] == [
        {k: v for k, v in i.items() if k != "id"} | {"id": f.id}
        for i, f in zip(whole["output"], final.output, strict=True)
    ]


def test_reasoning_comes_sealed_when_the_request_includes_it() -> None:
    chat = completion("ok", reasoning="think")
    sealed_req = request(include=["reasoning.encrypted_content"], store=False)
    _, final = run_sealed(sealed_req, chunks_of(chat))
    assert final.output[0].encrypted_content == _seal("think")
    assert api.response_object(sealed_req, chat, response_id="r", created_at=1, seal=_seal)["output"][0][
        "encrypted_content"
    ] == _seal("think")
    _, plain = run_sealed(request(), chunks_of(chat))  # not asked for: not sealed
    assert plain.output[0].encrypted_content is None


def run_sealed(req: api.ResponsesRequest, chunks: list[dict[str, Any]]) -> tuple[list[Any], Any]:
    stream = api.ResponseStream(req, response_id="resp_s", created_at=5, seal=_seal)
    events = [e for c in chunks for e in stream.feed(c)] + stream.finish()
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    final = None
    for _, data in events:
        for out in state.handle_event(EVENT.validate_python(data)):
            if out.type == "response.completed":
                final = out.response
    return events, final

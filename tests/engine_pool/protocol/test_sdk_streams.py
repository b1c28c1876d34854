"""Both named-event streams end to end through the real SDKs' stream helpers, over an in-memory HTTP
transport: chat chunks -> translator -> `sse.named_event` bytes -> `client.messages.stream` /
`client.responses.stream`. The streamed result must equal the non-streamed translation of the same
completion, and an in-stream failure must reach the SDK in the API's own shape."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from engine_pool.errors import ServerError
from engine_pool.protocol import anthropic_messages as messages
from engine_pool.protocol import openai_responses as responses
from engine_pool.protocol.sse import named_event

from .conftest import chunks_of, completion

Events = list[tuple[str, dict[str, Any]]]
# Newer anthropic SDKs run on httpx2 (and refuse httpx objects); older ones on httpx.
ANTHROPIC_HTTP = importlib.import_module("httpx2") if importlib.util.find_spec("httpx2") else httpx
ANTHROPIC_EVENT: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
USER = [{"role": "user", "content": "hi"}]


def transport(events: Events, http: Any = httpx) -> Any:
    """A client of the `http` package (the anthropic SDK uses httpx2) answering every request with
    the events as the engine would write them."""
    body = b"".join(named_event(n, d) for n, d in events)

    def handle(request: Any) -> Any:
        return http.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    return http.Client(transport=http.MockTransport(handle))


def anthropic_events(
    chat: dict[str, Any], req: messages.MessagesRequest, fail_after: int | None = None
) -> Events:
    stream = messages.MessageStream(req, message_id="msg_s")
    chunks = chunks_of(chat)
    if fail_after is not None:
        return [e for c in chunks[:fail_after] for e in stream.feed(c)] + stream.failed(
            ServerError("engine fault")
        )
    return [e for c in chunks for e in stream.feed(c)] + stream.finish()


def anthropic_client(events: Events) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        api_key="k", base_url="http://engine", http_client=transport(events, ANTHROPIC_HTTP), max_retries=0
    )


MESSAGE_CASES: list[tuple[str, Callable[[], dict[str, Any]], dict[str, Any]]] = [
    ("text", lambda: completion("Hello streaming world", prompt=12, cached=10, finish="length"), {}),
    ("stop sequence", lambda: completion("abc", stopping_word="END"), {"stop_sequences": ["END"]}),
    (
        "thinking, text and calls",
        lambda: completion(
            "Checking", reasoning="plan it", calls=[("call_1", "f", '{"a": [1, 2]}'), ("call_2", "f", "{}")]
        ),
        {"tools": [{"name": "f", "input_schema": {"type": "object"}}]},
    ),
]


@pytest.mark.parametrize(("name", "make", "fields"), MESSAGE_CASES, ids=[c[0] for c in MESSAGE_CASES])
def test_the_messages_stream_helper_rebuilds_the_message(
    name: str, make: Callable[[], dict[str, Any]], fields: dict[str, Any]
) -> None:
    chat = make()
    req = messages.parse_request(
        {"model": "m", "max_tokens": 50, "messages": USER, "stream": True, **fields}, max_messages=4
    )
    events = anthropic_events(chat, req)
    for n, d in events:
        assert ANTHROPIC_EVENT.validate_python(d).type == n
    with anthropic_client(events).messages.stream(model="m", max_tokens=50, messages=USER) as stream:  # type: ignore[arg-type]
        final = stream.get_final_message()
    whole = messages.message_object(req, chat, message_id="msg_s")
    assert final.model_dump(exclude={"content"}, exclude_none=True) == anthropic.types.Message.model_validate(
        whole
    ).model_dump(exclude={"content"}, exclude_none=True)
    assert [b.model_dump(exclude_none=True, exclude={"parsed_output"}) for b in final.content] == whole[
        "content"
    ]


def test_the_messages_event_sequence() -> None:
    req = messages.parse_request({"model": "m", "max_tokens": 5, "messages": USER}, max_messages=4)
    names = [n for n, _ in anthropic_events(completion("abcdef"), req)]
    assert names == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


def test_a_messages_failure_mid_stream_raises_in_the_sdk() -> None:
    req = messages.parse_request({"model": "m", "max_tokens": 5, "messages": USER}, max_messages=4)
    events = anthropic_events(completion("abcdef"), req, fail_after=2)
    assert events[-1] == (
        "error",
        {"type": "error", "error": {"type": "api_error", "message": "engine fault"}},
    )
    with pytest.raises(anthropic.APIStatusError) as exc:
        with anthropic_client(events).messages.stream(model="m", max_tokens=5, messages=USER) as stream:  # type: ignore[arg-type]
            stream.get_final_message()
    assert exc.value.body == {"type": "error", "error": {"type": "api_error", "message": "engine fault"}}


# -- Responses ----------------------------------------------------------------------------------
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}


def openai_client(events: Events) -> openai.OpenAI:
    return openai.OpenAI(
        api_key="k", base_url="http://engine/v1", http_client=transport(events), max_retries=0
    )


def test_the_responses_stream_helper_rebuilds_the_response() -> None:
    chat = completion("Let me call", calls=[("call_1", "f", '{"x": 1}')], prompt=50, cached=44)
    req = responses.parse_request({"model": "m", "input": "hi", "tools": [TOOL], "stream": True}, max_items=4)
    stream = responses.ResponseStream(req, response_id="resp_x", created_at=3)
    events = [e for c in chunks_of(chat) for e in stream.feed(c)]
    with openai_client(events).responses.stream(model="m", input="hi", tools=[TOOL]) as s:  # type: ignore[list-item]
        texts = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert "".join(texts) == "Let me call" == final.output_text
    assert final.id == "resp_x" and final.usage and final.usage.input_tokens_details.cached_tokens == 44
    call = final.output[1]
    assert call.type == "function_call" and call.parsed_arguments == {"x": 1}  # strict tools are parsed
    whole = responses.response_object(req, chat, response_id="resp_x", created_at=3)
    assert [i.model_dump(exclude_none=True, exclude={"id", "parsed_arguments"}) for i in final.output] == [
        {k: v for k, v in i.items() if k != "id"} for i in whole["output"]
    ]


def test_a_responses_failure_mid_stream_reaches_the_sdk_as_events() -> None:
    req = responses.parse_request({"model": "m", "input": "hi", "stream": True}, max_items=4)
    stream = responses.ResponseStream(req, response_id="resp_y", created_at=3)
    events = [e for c in chunks_of(completion("abcdef"))[:2] for e in stream.feed(c)] + stream.failed(
        ServerError("engine fault")
    )
    seen = list(openai_client(events).responses.create(model="m", input="hi", stream=True))
    assert [e.type for e in seen[-2:]] == ["error", "response.failed"]
    assert seen[-2].message == "engine fault" and seen[-1].response.error.message == "engine fault"  # type: ignore[union-attr]

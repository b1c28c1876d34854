"""The gateway's Responses dialect in-process: a stored response is written before the final event
goes out, and a store failure ends the stream with `response.failed`, never a false completion."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from engine_pool.protocol import openai_responses as api
from gateway.responses_routes import ResponsesDialect
from storage.errors import StoreUnavailable


def chat_chunks(text: str) -> list[dict[str, Any]]:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}

    def choice(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    usage = {
        "prompt_tokens": 10,
        "completion_tokens": 2,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 7},
    }
    return [
        choice({"role": "assistant", "content": None}),
        choice({"content": text}),
        choice({}, "stop"),
        {**head, "choices": [], "usage": usage},
    ]


class Store:
    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.saved: list[Any] = []

    async def save(self, stored: Any) -> None:
        if self.fail:
            raise StoreUnavailable("the bucket is away")
        self.saved.append(stored)


async def events(dialect: ResponsesDialect, chunks: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    async def source() -> AsyncIterator[dict[str, Any]]:
        for c in chunks:
            yield c

    out = []
    async for raw in dialect.stream(source(), SimpleNamespace(session="s-1")):  # type: ignore[arg-type]
        name, data = raw.decode().split("\n", 1)
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def dialect(store: Store) -> ResponsesDialect:
    req = api.parse_request({"model": "m", "input": "hi", "stream": True}, max_items=16)
    return ResponsesDialect(SimpleNamespace(responses=store), SimpleNamespace(name="t"), req, "m", [])  # type: ignore[arg-type]


async def test_the_response_is_stored_before_it_is_completed() -> None:
    store = Store(fail=False)
    got = await events(dialect(store), chat_chunks("hello"))
    assert got[-1][0] == "response.completed"
    [stored] = store.saved
    assert stored.session == "s-1" and stored.response["id"] == got[-1][1]["response"]["id"]
    assert stored.history[-1]["content"] == "hello"  # the output, as the next turn renders it
    assert stored.response["usage"]["input_tokens_details"]["cached_tokens"] == 7


async def test_a_store_failure_fails_the_response() -> None:
    got = await events(dialect(Store(fail=True)), chat_chunks("hello"))
    names = [n for n, _ in got]
    assert "response.completed" not in names and names[-1] == "response.failed"


@pytest.mark.parametrize("cut", [1, 2, 3])
async def test_a_broken_engine_stream_fails_the_response(cut: int) -> None:
    store = Store(fail=False)
    chunks = chat_chunks("hello")[:cut] + [{"error": {"message": "engine died"}}]
    got = await events(dialect(store), chunks)
    assert [n for n, _ in got][-1] in ("response.failed", "error") and not store.saved

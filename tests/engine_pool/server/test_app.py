"""engine_pool/server/app.py and engine_pool/protocol/sse.py in-process: 503 while loading, one error
shape, stream failures."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

import httpx

from engine_pool.errors import BadRequest, ContextSizeExceeded, api_error, error_payload
from engine_pool.protocol.sse import start_stream
from engine_pool.server.app import build_app
from engine_pool.server.runtime import Runtime
from engine_pool.server.settings import parse_settings
from native.errors import SlotBusyError, SlotFileError


def _loading_app() -> httpx.AsyncClient:
    # The lifespan is not run: the runtime stays in `loading`, as while a large model loads.
    rt = Runtime(parse_settings(["-m", "never-loaded.gguf", "--retry-after", "3", "--metrics"], {}))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(rt)), base_url="http://engine")


async def test_everything_answers_503_while_loading() -> None:
    async with _loading_app() as c:
        r = await c.get("/health")
        assert r.status_code == 503 and r.headers["retry-after"] == "3"
        assert r.json() == {
            "error": {
                "message": "Loading model",
                "type": "unavailable_error",
                "param": None,
                "code": "unavailable",
            },
            "progress": 0.0,  # the weights loaded so far, for the supervisor's console line
        }
        for method, path in [
            ("GET", "/props"),
            ("GET", "/slots"),
            ("POST", "/completion"),
            ("POST", "/v1/chat/completions"),
            ("POST", "/tokenize"),
        ]:
            r = await c.request(method, path, json={})
            assert r.status_code == 503, (path, r.text)
            assert r.json()["error"]["type"] == "unavailable_error"
        assert (await c.get("/v1/models")).json()["data"][0]["id"] == "never-loaded.gguf"
        metrics = (await c.get("/metrics")).text
        assert "slotkeeper_engine_ready 0.0" in metrics


async def test_routing_errors_use_the_same_shape() -> None:
    async with _loading_app() as c:
        r = await c.delete("/health")
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_native_errors_map_to_statuses() -> None:
    err = api_error(SlotFileError("checksum_mismatch", "bad crc"))
    assert (err.status, err.extra["kind"]) == (400, "checksum_mismatch")
    assert api_error(SlotBusyError("busy")).status == 409
    assert api_error(ValueError("boom")).status == 500
    payload = error_payload(ContextSizeExceeded(2000, 1024))
    assert payload["error"]["type"] == "exceed_context_size_error"
    assert (payload["error"]["n_prompt_tokens"], payload["error"]["n_ctx"]) == (2000, 1024)


async def _fails_after_one() -> AsyncGenerator[dict[str, Any], None]:
    yield {"n": 1}
    raise BadRequest("went wrong mid-stream")


async def _fails_at_once() -> AsyncGenerator[dict[str, Any], None]:
    raise BadRequest("wrong before the stream")
    yield {}  # pragma: no cover


async def test_a_stream_that_fails_after_it_started_ends_with_an_error_event() -> None:
    response = await start_stream(_fails_after_one(), done_marker=True)
    body = b"".join([chunk async for chunk in response.body_iterator])  # type: ignore[misc]
    events = [json.loads(line[6:]) for line in body.decode().split("\n\n") if line.startswith("data: ")]
    assert events[0] == {"n": 1}
    assert events[-1]["error"]["message"] == "went wrong mid-stream"
    assert b"[DONE]" not in body


async def test_a_stream_that_fails_before_its_first_item_is_an_ordinary_error() -> None:
    try:
        await start_stream(_fails_at_once(), done_marker=True)
    except BadRequest as exc:
        assert exc.message == "wrong before the stream"
    else:
        raise AssertionError("expected BadRequest")

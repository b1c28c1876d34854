"""Errors in each API's own shape: the one renderer's two styles, the engine app's handler and key
check choosing by path, and named-event streams failing in-band. In-process, no model loaded."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

import httpx
import pytest
from anthropic.types import ErrorResponse

from engine_pool.errors import (
    NotFound,
    PayloadTooLarge,
    RateLimited,
    ServerError,
    error_payload,
    error_style,
    for_status,
    render_error,
)
from engine_pool.protocol.sse import named_event, start_event_stream
from engine_pool.server.app import build_app
from engine_pool.server.runtime import Runtime
from engine_pool.server.settings import parse_settings

KEY = "k-123"


@pytest.mark.parametrize(
    ("path", "style"),
    [
        ("/v1/messages", "anthropic"),
        ("/v1/messages/count_tokens", "anthropic"),
        ("/messages", "anthropic"),
        ("/messages/count_tokens", "anthropic"),
        ("/v1/messagesx", "openai"),
        ("/v1/responses", "openai"),
        ("/v1/chat/completions", "openai"),
        ("/health", "openai"),
    ],
)
def test_error_style_by_path(path: str, style: str) -> None:
    assert error_style(path) == style


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (405, "invalid_request_error"),
        (409, "invalid_request_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (501, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
    ],
)
def test_anthropic_error_types_by_status(status: int, kind: str) -> None:
    err = for_status(status)("went wrong", status=status)
    payload = error_payload(err, "anthropic")
    assert payload == {"type": "error", "error": {"type": kind, "message": "went wrong"}}
    if kind != "request_too_large":  # Anthropic's documented 413 type; the SDK's union lacks it
        assert ErrorResponse.model_validate(payload).error.type == kind


def test_both_styles_keep_extras_and_retry_headers() -> None:
    err = PayloadTooLarge("too big", extra={"limit": 5})
    assert error_payload(err, "anthropic")["error"]["limit"] == 5
    assert (
        error_payload(err)
        == error_payload(err, "openai")
        == {
            "error": {
                "message": "too big",
                "type": "invalid_request_error",
                "param": None,
                "code": "payload_too_large",
                "limit": 5,
            }
        }
    )
    response = render_error(RateLimited("slow down", retry_after=2.5), "anthropic")
    assert response.status_code == 429 and response.headers["retry-after"] == "2"
    assert response.headers["retry-after-ms"] == "2500"
    assert json.loads(bytes(response.body))["error"]["type"] == "rate_limit_error"
    with pytest.raises(ValueError):
        error_payload(err, "xml")


# -- the engine app -----------------------------------------------------------------------------
def _app(*args: str) -> httpx.AsyncClient:
    # The lifespan is not run: the runtime stays `loading`, so nothing reaches a model.
    rt = Runtime(parse_settings(["-m", "never-loaded.gguf", "--retry-after", "3", *args], {}))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(rt)), base_url="http://engine")


MESSAGE = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


async def test_the_handler_answers_in_each_apis_shape() -> None:
    async with _app() as c:
        r = await c.post("/v1/messages", json=MESSAGE)
        assert r.status_code == 503 and r.headers["retry-after"] == "3"
        assert r.json() == {
            "type": "error",
            "error": {"type": "overloaded_error", "message": "Loading model"},
        }
        r = await c.post("/v1/messages/count_tokens", json=MESSAGE)
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
        r = await c.post("/v1/responses", json={"model": "m", "input": "hi"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable_error"
        r = await c.get("/v1/messages")
        assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
        r = await c.post("/v1/messages/nope", json={})
        assert r.status_code == 404 and r.json() == {
            "type": "error",
            "error": {"type": "not_found_error", "message": "Not Found"},
        }


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}


async def test_malformed_requests_are_refused_before_the_model() -> None:
    async with _app() as c:
        r = await c.post("/v1/messages", json={**MESSAGE, "messages": [{"role": "user", "content": [IMAGE]}]})
        assert r.status_code == 400
        body = ErrorResponse.model_validate(r.json())
        assert (
            body.error.type == "invalid_request_error"
            and "image input is not supported" in body.error.message
        )
        r = await c.post("/v1/messages", content=b"{not json")
        assert r.status_code == 400 and r.json()["type"] == "error"
        r = await c.post(
            "/v1/responses",
            json={
                "model": "m",
                "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
            },
        )
        assert r.status_code == 400
        assert (
            r.json()["error"]["param"] == "input[0].content[0]"
            and r.json()["error"]["code"] == "invalid_request"
        )


async def test_a_bare_engine_keeps_no_responses() -> None:
    async with _app() as c:
        r = await c.post(
            "/v1/responses", json={"model": "m", "input": "hi", "previous_response_id": "resp_1"}
        )
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
        assert "keeps no responses" in r.json()["error"]["message"]
        for method, path in [
            ("GET", "/v1/responses/resp_1"),
            ("DELETE", "/v1/responses/resp_1"),
            ("GET", "/v1/responses/resp_1/input_items"),
        ]:
            r = await c.request(method, path)
            assert r.status_code == 404, path
            assert (
                r.json()["error"]["type"] == "not_found_error" and "'resp_1'" in r.json()["error"]["message"]
            )


async def test_the_key_is_accepted_as_x_api_key_and_refused_in_each_shape() -> None:
    async with _app("--api-key", KEY) as c:
        r = await c.post("/v1/messages", json=MESSAGE)
        assert r.status_code == 401
        assert r.json() == {
            "type": "error",
            "error": {"type": "authentication_error", "message": "Invalid API Key"},
        }
        r = await c.post("/v1/messages", json=MESSAGE, headers={"x-api-key": "wrong"})
        assert r.status_code == 401
        r = await c.post("/v1/responses", json={"model": "m", "input": "hi"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert r.json()["error"]["code"] == "invalid_api_key"
        # Past the key check: the model is still loading.
        r = await c.post(
            "/v1/messages", json=MESSAGE, headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}
        )
        assert r.status_code == 503
        r = await c.post(
            "/v1/responses", json={"model": "m", "input": "hi"}, headers={"Authorization": f"Bearer {KEY}"}
        )
        assert r.status_code == 503


# -- named-event streams ------------------------------------------------------------------------
async def _two_then_fail() -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
    yield "first", {"n": 1}
    yield "second", {"n": 2}
    raise ServerError("broke mid-stream")


async def _fails_at_once() -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
    raise NotFound("gone before the stream")
    yield "never", {}  # pragma: no cover


def _failed(err: Any) -> list[tuple[str, dict[str, Any]]]:
    return [("error", error_payload(err, "anthropic")), ("after", {"status": err.status})]


async def test_a_named_stream_fails_in_band_and_has_no_done_marker() -> None:
    response = await start_event_stream(_two_then_fail(), failed=_failed)
    body = b"".join([chunk async for chunk in response.body_iterator])  # type: ignore[misc]
    assert body == (
        b'event: first\ndata: {"n":1}\n\n'
        b'event: second\ndata: {"n":2}\n\n'
        b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"broke mid-stream"}}\n\n'
        b'event: after\ndata: {"status":500}\n\n'
    )
    assert response.media_type == "text/event-stream"


async def test_a_named_stream_that_fails_before_its_first_event_is_an_ordinary_error() -> None:
    with pytest.raises(NotFound):
        await start_event_stream(_fails_at_once(), failed=_failed)


def test_event_names_cannot_break_the_framing() -> None:
    assert named_event("ok", {"a": "é"}) == 'event: ok\ndata: {"a":"é"}\n\n'.encode()
    with pytest.raises(ValueError):
        named_event("bad\ndata: x", {})

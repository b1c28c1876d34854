"""Server-sent events: `data: <json>` chunks or named events, an error event when a started stream
fails, never a hang.

Two kinds of stream share one body loop:
- chat and completion chunks (`start_stream`): `data: <json>` events, ended by `data: [DONE]`; a
  failure after the start is a last `data: {"error": {...}}` event (which the OpenAI SDK raises as
  APIError);
- named events (`start_event_stream`, the Responses and Anthropic Messages APIs): `event: NAME` +
  `data: <json>`, no `[DONE]` marker; a failure after the start becomes the events the API's own
  stream translator says (`failed`: Responses' `error` + `response.failed`, Anthropic's
  `event: error`), so the client reads it in the shape its SDK parses.

A stream's first item is produced before the response starts, so anything that fails up front —
validation, a full queue, a context overflow — is still an ordinary HTTP error from the app's one
handler. The body iterator is always closed, also when the client goes away, so the generation under
it is cancelled and its slot given back.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any

import structlog
from starlette.responses import StreamingResponse
from starlette.types import Send

from engine_pool.errors import ApiError, api_error, error_payload

log = structlog.get_logger("engine.sse")

DONE = b"data: [DONE]\n\n"

NamedEvent = tuple[str, dict[str, Any]]


def _json(data: Any) -> bytes:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def event(data: Any) -> bytes:
    return b"data: " + _json(data) + b"\n\n"


def named_event(name: str, data: Any) -> bytes:
    """`event: NAME` + `data: <json>` (names are the APIs' own: never contain a newline)."""
    if "\n" in name or "\r" in name:
        raise ValueError(f"an SSE event name cannot hold a line break: {name!r}")
    return b"event: " + name.encode() + b"\n" + event(data)


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content: AsyncGenerator[bytes, None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._source = content

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self._source, "aclose", None)
            if aclose is not None:
                await aclose()


async def start_stream(items: AsyncGenerator[Mapping[str, Any], None], *, done_marker: bool) -> SSEResponse:
    """Wait for the first item (errors so far are plain HTTP errors), then stream the rest as
    `data:` events; a failure after the start is a last OpenAI-shaped error event."""
    return await _start(
        items,
        encode=event,
        fail=lambda err: event(error_payload(err)),
        tail=DONE if done_marker else b"",
    )


async def start_event_stream(
    items: AsyncGenerator[NamedEvent, None], *, failed: Callable[[ApiError], list[NamedEvent]]
) -> SSEResponse:
    """Named events (`(name, payload)` items): wait for the first (errors so far are plain HTTP
    errors), then stream the rest; a failure after the start ends the stream with `failed(err)`."""

    def fail(err: ApiError) -> bytes:
        return b"".join(named_event(name, data) for name, data in failed(err))

    return await _start(items, encode=lambda item: named_event(*item), fail=fail, tail=b"")


async def _start(
    items: AsyncGenerator[Any, None],
    *,
    encode: Callable[[Any], bytes],
    fail: Callable[[ApiError], bytes],
    tail: bytes,
) -> SSEResponse:
    try:
        first = await anext(items)
    except StopAsyncIteration:
        first = None
    except BaseException:
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            await aclose()
        raise
    return SSEResponse(_body(first, items, encode, fail, tail))


async def _body(
    first: Any,
    items: AsyncGenerator[Any, None],
    encode: Callable[[Any], bytes],
    fail: Callable[[ApiError], bytes],
    tail: bytes,
) -> AsyncGenerator[bytes, None]:
    try:
        if first is not None:
            yield encode(first)
            async for item in items:
                yield encode(item)
    except Exception as exc:  # the stream has started: report in-band and end it
        err = api_error(exc)
        log.warning("stream.failed", error=err.message, type=err.type)
        yield fail(err)
        return
    finally:
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            await aclose()
    if tail:
        yield tail

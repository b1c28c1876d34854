"""Server-sent events: `data: <json>` chunks, an error event when a started stream fails, never a hang.

A stream's first item is produced before the response starts (`start_stream`), so anything that
fails up front — validation, a full queue, a context overflow — is still an ordinary HTTP error
from the app's one handler. After that, a failure becomes a last `data: {"error": {...}}` event
(which the OpenAI SDK raises as APIError). The body iterator is always closed, also when the client
goes away, so the generation under it is cancelled and its slot given back.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

import structlog
from starlette.responses import StreamingResponse
from starlette.types import Send

from ..errors import api_error, error_payload

log = structlog.get_logger("engine.sse")

DONE = b"data: [DONE]\n\n"


def event(data: Any) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


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


async def start_stream(items: AsyncGenerator[dict[str, Any], None], *, done_marker: bool) -> SSEResponse:
    """Wait for the first item (errors so far are plain HTTP errors), then stream the rest."""
    try:
        first = await anext(items)
    except StopAsyncIteration:
        first = None
    except BaseException:
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            await aclose()
        raise
    return SSEResponse(_body(first, items, done_marker))


async def _body(
    first: dict[str, Any] | None, items: AsyncGenerator[dict[str, Any], None], done_marker: bool
) -> AsyncGenerator[bytes, None]:
    try:
        if first is not None:
            yield event(first)
            async for item in items:
                yield event(item)
    except Exception as exc:  # the stream has started: report in-band and end it
        err = api_error(exc)
        log.warning("stream.failed", error=err.message, type=err.type)
        yield event(error_payload(err))
        return
    finally:
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            await aclose()
    if done_marker:
        yield DONE

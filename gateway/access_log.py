"""One line per request (`http.access`), for whoever reads the console: method, path, status, the
tenant, the session and how its state was served, tokens, and the time to the last byte.

The turn's handler leaves what only it knows in the request's state (`note`); the session and the
cache source come from the answer's own headers, so every API reports them alike. Polls of
/health, /ready and /metrics are logged at debug level: they would be most of the lines.
"""

from __future__ import annotations

import time
from typing import Any

import structlog
from starlette.requests import Request
from starlette.types import Message, Receive, Scope, Send

from engine_pool.http.middleware import HttpMiddleware

log = structlog.get_logger("gateway.access")

POLLS = frozenset({"/health", "/ready", "/metrics"})
_MAX_PATH = 200  # a path is the client's text: the line keeps a bounded part of it
_KEY = "access"


def note(request: Request, **fields: Any) -> None:
    """Add `fields` to the request's access line."""
    state = request.scope.setdefault("state", {})
    state.setdefault(_KEY, {}).update(fields)


class AccessLog(HttpMiddleware):
    """ASGI middleware writing the access line once the response is over (a stream: its end, or
    the client's disconnect; a request that raised: as it passes on to the error handler, 500)."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        t0 = time.perf_counter()
        answer: dict[str, Any] = {"status": 500}

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                answer["status"] = message["status"]
                for name, value in message.get("headers", ()):
                    if name == b"x-session-id":
                        answer["session"] = value.decode("latin-1")
                    elif name == b"x-slotkeeper-cache":
                        answer["cache"] = value.decode("latin-1")
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            path = scope["path"]
            noted = scope.get("state", {}).get(_KEY, {})
            emit = log.debug if path in POLLS else log.info
            emit(
                "http.access",
                method=scope["method"],
                path=path[:_MAX_PATH],
                **answer,
                **noted,
                ms=round((time.perf_counter() - t0) * 1000, 2),
            )

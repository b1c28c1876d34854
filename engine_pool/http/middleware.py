"""ASGI middleware that acts on HTTP requests only: the base of the edge layers of the engine and
the gateway (CORS, the engine's key check and request log, the gateway's request counter).

Any other scope (the lifespan; a websocket, which no route serves) passes through untouched, so a
layer is written for one HTTP request: its `handle`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from starlette.types import ASGIApp, Receive, Scope, Send


class HttpMiddleware(ABC):
    """Wraps `app`; HTTP requests go to `handle`, every other scope straight to `app`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    @abstractmethod
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer, or pass on to `self.app`, one HTTP request."""

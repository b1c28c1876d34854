"""The engine process's Starlette app: routes, the one error handler, the edge middleware, the lifespan.

The lifespan starts the model load in a worker thread and yields at once, so the server answers
while the model loads (`/health` 503); it closes the native engine on shutdown. CORS is the
outermost layer (`cors.CorsMiddleware`, llama-server's `--cors-*` rules): a browser's preflight
carries no API key, so it is answered before the key check, as llama-server does, and every
response to an allowed Origin says so. With `--ui-mcp-proxy` the lifespan also holds the HTTP
client of `/cors-proxy` (`cors_proxy`). Every error leaves through `handle_error` ->
`errors.render_error`, in the shape of the API the path belongs to (`errors.error_style`:
Anthropic's on /v1/messages, OpenAI's elsewhere).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine_pool.errors import (
    INSTANCE_HEADER,
    ApiError,
    InstanceChanged,
    Unauthorized,
    api_error,
    error_style,
    is_expected,
    render_error,
)
from engine_pool.http.cors import CorsMiddleware, CorsPolicy
from engine_pool.http.credentials import matches, presented
from engine_pool.http.middleware import HttpMiddleware
from native.errors import NativeError

from ..protocol.metric_labels import route_label
from . import cors_proxy, routes_llama, routes_openai
from .apis import routes as routes_apis
from .apis import vertex
from .limits import RequestLimits
from .runtime import Runtime
from .settings import EngineSettings

log = structlog.get_logger("engine.http")

# llama-server answers these without an API key.
PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/models", "/v1/models"})
QUIET_PATHS = frozenset({"/health", "/v1/health", "/metrics"})
VERBOSE_BODY_BYTES = 64 << 10  # what -v logs of each request and response body


async def handle_error(request: Request, exc: Exception) -> Response:
    err = api_error(exc)
    if not is_expected(exc):
        log.error("http.unhandled", error=err.message, exc_info=exc)
    return render_error(err, error_style(request.url.path))


class EdgeMiddleware(HttpMiddleware):
    """Per request: a request id bound to the logs, the API key check, the instance fence, HTTP
    metrics and one log line.

    The fence: a request that names an engine process (`X-Slotkeeper-Instance`, the `--instance-id`
    its node gave it) is refused with 409 unless it names this one, before anything reaches a slot.
    The gateway names it when it sends a turn before its opening read confirmed the placement
    (`gateway.turn.early`): a restarted engine's slots may hold other sessions by then.

    The key is read as `Authorization: Bearer KEY` or `X-Api-Key: KEY` (what the Anthropic SDK
    sends), `credentials.presented`. With `-v` the request and response bodies are logged too
    (`http.body`, debug, the first `VERBOSE_BODY_BYTES` of each), as llama-server's verbose log does."""

    def __init__(self, app: ASGIApp, runtime: Runtime) -> None:
        super().__init__(app)
        self.runtime = runtime

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        request_id = headers.get("x-request-id") or secrets.token_hex(8)
        path = scope["path"]
        structlog.contextvars.bind_contextvars(request_id=request_id, path=path)
        status = 500
        t0 = time.monotonic()
        verbose = self.runtime.settings.verbose
        bodies = (bytearray(), bytearray())  # request, response: kept only with -v

        async def receive_wrapper() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                _keep(bodies[0], message.get("body", b""))
            return message

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", []).append((b"x-request-id", request_id.encode("latin-1")))
            elif verbose and message["type"] == "http.response.body":
                _keep(bodies[1], message.get("body", b""))
            await send(message)

        try:
            key = self.runtime.settings.api_key
            if key and path not in PUBLIC_PATHS and not matches(presented(headers), key):
                err: ApiError = Unauthorized("Invalid API Key")
                await render_error(err, error_style(path))(scope, receive, send_wrapper)
                return
            named = headers.get(INSTANCE_HEADER)
            if named is not None and named != (self.runtime.settings.instance_id or ""):
                err = InstanceChanged("this request names another engine process; ask the registry again")
                await render_error(err, error_style(path))(scope, receive, send_wrapper)
                return
            await self.app(scope, receive_wrapper if verbose else receive, send_wrapper)
        finally:
            ms = round((time.monotonic() - t0) * 1000.0, 2)
            if verbose:
                log.debug(
                    "http.body",
                    request=bodies[0].decode("utf-8", "replace"),
                    response=bodies[1].decode("utf-8", "replace"),
                )
            self.runtime.metrics.http_request(route_label(path, _ROUTES), status)
            # Probes and scrapes would drown the request log.
            emit = log.debug if path in QUIET_PATHS and status < 400 else log.info
            emit("http.request", method=scope["method"], status=status, ms=ms)
            structlog.contextvars.unbind_contextvars("request_id", "path")


def cors_policy(settings: EngineSettings) -> CorsPolicy:
    """The engine's CORS: llama-server's `--cors-origins/-methods/-headers/--cors-credentials`."""
    return CorsPolicy(
        settings.cors_origin_list, settings.cors_methods, settings.cors_headers, settings.cors_credentials
    )


def _keep(buf: bytearray, data: bytes) -> None:
    buf += data[: max(0, VERBOSE_BODY_BYTES - len(buf))]


_ROUTES = routes_llama.ROUTES + routes_openai.ROUTES + routes_apis.ROUTES + cors_proxy.ROUTES


def build_app(runtime: Runtime, on_fatal: Callable[[], None] | None = None) -> Starlette:
    """The app over `runtime`; `on_fatal` is called when the model fails to load (the process exits)."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async def load() -> None:
            await runtime.load()
            if runtime.state == "failed" and on_fatal is not None:
                on_fatal()

        loading = asyncio.create_task(load())
        proxy = cors_proxy.client() if runtime.settings.ui_mcp_proxy else None
        app.state.cors_proxy = proxy  # None: /cors-proxy answers 403, as llama-server without the flag
        try:
            yield
        finally:
            await asyncio.gather(loading, return_exceptions=True)  # a load in flight cannot be interrupted
            if proxy is not None:
                await proxy.aclose()
            await runtime.close()

    app = Starlette(
        routes=_ROUTES + vertex.routes(runtime.settings.predict_route),
        lifespan=lifespan,
        exception_handlers={
            ApiError: handle_error,
            NativeError: handle_error,
            HTTPException: handle_error,
            Exception: handle_error,
        },
    )
    app.state.runtime = runtime
    app.state.limits = RequestLimits.from_settings(runtime.settings)  # built once, read by every route
    app.add_middleware(EdgeMiddleware, runtime=runtime)
    # Added last, so outermost: preflights are answered before EdgeMiddleware asks for a key.
    app.add_middleware(CorsMiddleware, policy=cors_policy(runtime.settings))
    return app

"""The gateway's HTTP API (OpenAI-compatible, multi-tenant) and its lifespan.

Clients — Redis (or the in-process index), the blob store, the HTTP client for engines and nodes —
are created in the lifespan and handed down; errors leave through engine_pool.errors only
(`api_error` → `render_error`). CORS (`--cors-origins`, engine_pool/http/cors.py) is the outermost
layer, so a browser's preflight, which carries no key, is answered before any route asks for a
tenant's key.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import Any

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine_pool.errors import ApiError, NotFound, api_error, error_style, is_expected, render_error
from engine_pool.http.cors import DEFAULT_METHODS, MIRROR, CorsMiddleware, CorsPolicy
from engine_pool.process.flags import parse_list
from gateway import messages_routes, responses_routes
from gateway.access_log import AccessLog
from gateway.metrics import Metrics, RequestCounter
from gateway.requests import (
    check_messages,
    counted_if_refused,
    forward_stateless,
    raw_json_body,
    served_model,
    stateless_request,
    tenant_of,
)
from gateway.services import Services
from gateway.tenants import is_pattern
from gateway.turn.serving import serve_turn
from storage.errors import StorageError

log = structlog.get_logger("slotkeeper.gateway")


async def _turn(request: Request, path: str) -> Response:
    async with counted_if_refused(request) as (svc, tenant):
        raw, body = await raw_json_body(request)
        model = await served_model(svc, tenant, body.get("model"))
        messages = check_messages(body, svc.settings.max_messages) if path == "/v1/chat/completions" else []
    return await serve_turn(request, tenant, body, model, messages, path, raw=raw)


def _turn_route(path: str) -> Route:
    """A turn's endpoint, at the engine's path that it forwards the turn to."""

    async def turn(request: Request) -> Response:
        return await _turn(request, path)

    return Route(path, turn, methods=["POST"])


async def input_tokens(request: Request) -> Response:
    """How many prompt tokens a chat request would take (llama-server's /chat/completions/input_tokens)."""
    svc, body, model = await stateless_request(request)
    check_messages(body, svc.settings.max_messages)
    payload = await forward_stateless(svc, model, "/v1/chat/completions/input_tokens", body)
    return JSONResponse(payload)


async def models(request: Request) -> Response:
    svc: Services = request.app.state.services
    tenant = tenant_of(request)
    served = sorted(await svc.cluster.models(fresh=True))
    names = served + sorted(a for a, m in tenant.models.items() if m in served and not is_pattern(a))
    data = [
        {"id": n, "object": "model", "created": 0, "owned_by": "slotkeeper", "status": "ready"} for n in names
    ]
    # A model whose engines were given up (failed to start the same way again and again) is listed
    # with why: the first thing a new user asks is why their model is not there.
    failed = await svc.cluster.failed_models()
    data += [
        {"id": m, "object": "model", "created": 0, "owned_by": "slotkeeper", "status": "failed", "error": why}
        for m, why in sorted(failed.items())
        if m not in served
    ]
    return JSONResponse({"object": "list", "data": data})


def _record(rec: Any) -> dict[str, Any]:
    out = asdict(rec)
    out["id"] = out.pop("session")
    out["state"] = rec.state.value
    out.pop("tenant")
    return out


async def list_sessions(request: Request) -> Response:
    svc: Services = request.app.state.services
    tenant = tenant_of(request)
    data = []
    for sid in await svc.index.list_sessions(tenant.name):
        rec = await svc.index.find(tenant.name, sid)
        if rec is not None:
            data.append(_record(rec))
    return JSONResponse({"object": "list", "data": data})


async def session_detail(request: Request) -> Response:
    svc: Services = request.app.state.services
    tenant = tenant_of(request)
    sid = request.path_params["session"]
    if request.method == "DELETE":
        deleted = await svc.runner.delete(tenant, sid)
        return JSONResponse({"id": deleted.session, "object": "session", "deleted": True})
    await svc.runner.settled(tenant.name, sid)  # a read right after an answer sees its bookkeeping
    found = await svc.index.find(tenant.name, sid)
    if found is None:
        raise NotFound(f"session {sid} not found")
    return JSONResponse(_record(found))


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """200 once an engine is registered; else 503 saying why (an engine's own reason for giving up,
    engines still starting, node agents that do not answer)."""
    svc: Services = request.app.state.services
    engines = await svc.cluster.engines(fresh=True)
    if engines:
        return JSONResponse({"status": "ready", "engines": len(engines)})
    reason = await svc.cluster.not_ready_reason()
    return JSONResponse({"status": "no engines", "engines": 0, "reason": reason}, status_code=503)


async def metrics_endpoint(request: Request) -> Response:
    svc: Services = request.app.state.services
    return Response(generate_latest(svc.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _on_error(request: Request, exc: Exception) -> Response:
    if not is_expected(exc):
        log.exception("gateway.unhandled", path=request.url.path)
    return render_error(api_error(exc), error_style(request.url.path))


def gateway_cors(origins: str) -> CorsPolicy:
    """The gateway's CORS: llama-server's origin rules (`*`, `localhost`, listed origins). No
    credentials: tenants present keys, not cookies, so `*` stays `*`. A preflight is allowed the
    headers it asks for: `Access-Control-Allow-Headers: *` never covers Authorization in a browser,
    and every SDK sends its own (x-stainless-*, anthropic-version)."""
    return CorsPolicy(parse_list(origins), DEFAULT_METHODS, MIRROR, credentials=False)


def build_app(
    make_services: Callable[[], contextlib.AbstractAsyncContextManager[Services]],
    metrics: Metrics,
    cors_origins: str = "*",
) -> Starlette:
    """The gateway app. CORS (`--cors-origins`) is outermost, so a browser's preflight is answered
    before any key check (`gateway_cors`)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with make_services() as services:
            app.state.services = services
            yield
            await services.runner.drain()

    routes = [
        _turn_route("/v1/chat/completions"),
        Route("/v1/chat/completions/input_tokens", input_tokens, methods=["POST"]),
        _turn_route("/v1/completions"),
        Route("/v1/models", models, methods=["GET"]),
        *responses_routes.ROUTES,
        *messages_routes.ROUTES,
        Route("/v1/sessions", list_sessions, methods=["GET"]),
        Route("/v1/sessions/{session}", session_detail, methods=["GET", "DELETE"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        # The expected errors by class: Starlette's catch-all `Exception` handler re-raises after
        # answering (uvicorn then logs a traceback and drops the connection), so it is for bugs only.
        exception_handlers={e: _on_error for e in (ApiError, StorageError, HTTPException, Exception)},
        middleware=[
            Middleware(AccessLog),
            Middleware(CorsMiddleware, policy=gateway_cors(cors_origins)),
            Middleware(RequestCounter, metrics=metrics, routes=routes),
        ],
    )

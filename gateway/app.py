"""The gateway's HTTP API (OpenAI-compatible, multi-tenant) and its lifespan.

Clients — Redis (or the in-process index), the blob store, the HTTP client for engines and nodes —
are created in the lifespan and handed down; errors leave through gateway.errors only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.cluster import Cluster
from gateway.errors import BadRequest, GatewayError, NotFound, QuotaExceeded, Unauthorized, error_response
from gateway.metrics import Metrics, RequestCounter
from gateway.relay import EngineUnreachable, StreamRelay, TurnOutcome, forward_json
from gateway.settings import GatewaySettings
from gateway.tenants import Tenant, Tenants
from gateway.turns import Turn, TurnRunner
from storage.blobstore import BlobStore
from storage.engines import EngineRegistry
from storage.errors import StorageError
from storage.index import SessionIndex
from storage.locks import SessionLocks

log = structlog.get_logger("slotkeeper.gateway")


@dataclass
class Services:
    settings: GatewaySettings
    tenants: Tenants
    index: SessionIndex
    locks: SessionLocks
    registry: EngineRegistry
    store: BlobStore
    http: httpx.AsyncClient
    cluster: Cluster
    runner: TurnRunner
    metrics: Metrics


def _key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("x-api-key")


def _tenant(request: Request) -> Tenant:
    svc: Services = request.app.state.services
    tenant = svc.tenants.authenticate(_key(request))
    if tenant is None:
        raise Unauthorized("a valid API key is required (Authorization: Bearer KEY)")
    return tenant


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except ValueError as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


async def _rate_limit(svc: Services, tenant: Tenant) -> None:
    limit = tenant.quotas.requests_per_minute
    if limit is None:
        return
    minute = int(time.time() // 60)
    counts = await svc.index.incr_usage(tenant.name, {f"rpm_{minute}": 1})
    if counts.get(f"rpm_{minute}", 0) > limit:
        raise QuotaExceeded(
            f"tenant {tenant.name} exceeded {limit} requests per minute", retry_after=60 - time.time() % 60
        )


async def _model(svc: Services, tenant: Tenant, body: dict[str, Any]) -> str:
    requested = body.get("model")
    if not isinstance(requested, str) or not requested:
        raise BadRequest("'model' is required", param="model")
    model = tenant.model_id(requested, await svc.cluster.models())
    if model is None:
        raise NotFound(f"the model {requested!r} does not exist or is not served right now", param="model")
    return model


def _headers(turn: Turn) -> dict[str, str]:
    return {"X-Session-Id": turn.session, "X-Slotkeeper-Cache": turn.placement.serve.value}


async def _turn(request: Request, path: str) -> Response:
    svc: Services = request.app.state.services
    tenant = _tenant(request)
    body = await _json(request)
    await _rate_limit(svc, tenant)
    model = await _model(svc, tenant, body)
    if path == "/v1/chat/completions" and not isinstance(body.get("messages"), list):
        raise BadRequest("'messages' must be a list", param="messages")
    session, source = await svc.runner.resolve(tenant, request.headers, body, model)
    turn = await svc.runner.begin(tenant, session, model, source)
    raw_messages = body.get("messages")
    messages: list[dict[str, Any]] = raw_messages if isinstance(raw_messages, list) else []
    upstream = {k: v for k, v in body.items() if k not in ("prompt_cache_key", "id_slot")}
    upstream.update(model=model, id_slot=turn.placement.slot, cache_prompt=True)
    svc.metrics.served.labels(turn.placement.serve.value).inc()
    url = turn.engine_url.rstrip("/") + path
    t0 = time.perf_counter()
    if not body.get("stream"):
        outcome = TurnOutcome()
        try:
            payload, outcome = await forward_json(svc.http, url, upstream)
        except GatewayError as exc:
            outcome.error, outcome.engine_failed = exc.message, isinstance(exc, EngineUnreachable)
            await svc.runner.finish(turn, messages, outcome)
            raise
        svc.metrics.ttft.observe(time.perf_counter() - t0)
        svc.metrics.turn_served(turn.placement.serve.value, outcome.timings)
        await svc.runner.finish(turn, messages, outcome)
        return JSONResponse(payload, headers=_headers(turn))
    try:
        relay = await StreamRelay.open(svc.http, url, upstream)
    except GatewayError as exc:
        await svc.runner.finish(
            turn, messages, TurnOutcome(error=exc.message, engine_failed=isinstance(exc, EngineUnreachable))
        )
        raise
    svc.metrics.ttft.observe(time.perf_counter() - t0)

    async def relayed() -> AsyncIterator[bytes]:
        try:
            async for chunk in relay.chunks():
                yield chunk
        finally:
            # Also when the client went away mid-stream: the session must not stay locked. A task,
            # so that the cancellation of this generator cannot cut the bookkeeping short.
            svc.metrics.turn_served(turn.placement.serve.value, relay.outcome.timings)
            done = asyncio.create_task(svc.runner.finish(turn, messages, relay.outcome))
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(done)

    return StreamingResponse(relayed(), media_type="text/event-stream", headers=_headers(turn))


async def chat(request: Request) -> Response:
    return await _turn(request, "/v1/chat/completions")


async def completions(request: Request) -> Response:
    return await _turn(request, "/v1/completions")


async def models(request: Request) -> Response:
    svc: Services = request.app.state.services
    tenant = _tenant(request)
    served = sorted(await svc.cluster.models())
    names = served + sorted(a for a, m in tenant.models.items() if m in served)
    data = [{"id": n, "object": "model", "created": 0, "owned_by": "slotkeeper"} for n in names]
    return JSONResponse({"object": "list", "data": data})


def _record(rec: Any) -> dict[str, Any]:
    out = asdict(rec)
    out["id"] = out.pop("session")
    out["state"] = rec.state.value
    out.pop("tenant")
    return out


async def list_sessions(request: Request) -> Response:
    svc: Services = request.app.state.services
    tenant = _tenant(request)
    data = []
    for sid in await svc.index.list_sessions(tenant.name):
        rec = await svc.index.find(tenant.name, sid)
        if rec is not None:
            data.append(_record(rec))
    return JSONResponse({"object": "list", "data": data})


async def session_detail(request: Request) -> Response:
    svc: Services = request.app.state.services
    tenant = _tenant(request)
    sid = request.path_params["session"]
    if request.method == "DELETE":
        deleted = await svc.runner.delete(tenant, sid)
        return JSONResponse({"id": deleted.session, "object": "session", "deleted": True})
    found = await svc.index.find(tenant.name, sid)
    if found is None:
        raise NotFound(f"session {sid} not found")
    return JSONResponse(_record(found))


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    svc: Services = request.app.state.services
    engines = await svc.cluster.engines()
    status = 200 if engines else 503
    return JSONResponse(
        {"status": "ready" if engines else "no engines", "engines": len(engines)}, status_code=status
    )


async def metrics_endpoint(request: Request) -> Response:
    svc: Services = request.app.state.services
    return Response(generate_latest(svc.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _on_error(request: Request, exc: Exception) -> Response:
    if isinstance(exc, GatewayError):
        return error_response(exc)
    if isinstance(exc, StorageError):
        err = GatewayError(str(exc))
        err.status, err.type, err.code = (
            exc.status,
            "invalid_request_error" if exc.status < 500 else "server_error",
            exc.code,
        )
        return error_response(err)
    log.exception("gateway.unhandled", path=request.url.path)
    return error_response(GatewayError(f"internal error: {type(exc).__name__}"))


def build_app(
    make_services: Callable[[], contextlib.AbstractAsyncContextManager[Services]], metrics: Metrics
) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with make_services() as services:
            app.state.services = services
            yield
            await services.runner.drain()

    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/sessions", list_sessions, methods=["GET"]),
        Route("/v1/sessions/{session}", session_detail, methods=["GET", "DELETE"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={Exception: _on_error},
        middleware=[Middleware(RequestCounter, metrics=metrics)],
    )

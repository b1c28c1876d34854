"""The gateway's HTTP API (OpenAI-compatible, multi-tenant) and its lifespan.

Clients — Redis (or the in-process index), the blob store, the HTTP client for engines and nodes —
are created in the lifespan and handed down; errors leave through engine_pool.errors only
(`api_error` → `render_error`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine_pool.body import parse_json_object, read_body
from engine_pool.credentials import presented
from engine_pool.errors import (
    ApiError,
    BadRequest,
    NotFound,
    QuotaExceeded,
    RateLimited,
    Unauthorized,
    Unavailable,
    api_error,
    is_expected,
    render_error,
)
from gateway.cluster import Cluster
from gateway.metrics import Metrics, RequestCounter
from gateway.relay import StreamRelay, TurnOutcome, forward_json
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


def _tenant(request: Request) -> Tenant:
    svc: Services = request.app.state.services
    tenant = svc.tenants.authenticate(presented(request.headers) or None)
    if tenant is None:
        raise Unauthorized("a valid API key is required (Authorization: Bearer KEY)")
    return tenant


async def _json(request: Request) -> dict[str, Any]:
    svc: Services = request.app.state.services
    limits = svc.settings.body_limits()
    return parse_json_object(await read_body(request, limits), limits)


async def _rate_limit(svc: Services, tenant: Tenant) -> None:
    """Requests per minute: one counter per tenant and minute, expiring with its window."""
    limit = tenant.quotas.requests_per_minute
    if limit is None:
        return
    count = await svc.index.incr_window(tenant.name, "rpm", 60)
    if count > limit:
        raise QuotaExceeded(
            f"tenant {tenant.name} exceeded {limit} requests per minute", retry_after=60 - time.time() % 60
        )


async def _admit(svc: Services, tenant: Tenant) -> Callable[[], Awaitable[None]]:
    """Take one of the tenant's in-flight places (429 + Retry-After when none is free) and return
    its release (idempotent). Places of a gateway that died lapse by themselves."""
    limit = tenant.quotas.inflight or svc.settings.max_inflight
    token = await svc.index.acquire_inflight(tenant.name, limit, ttl_s=svc.settings.request_timeout_s + 60)
    if token is None:
        raise RateLimited(f"tenant {tenant.name} already has {limit} requests running", retry_after=1)
    released = False

    async def release() -> None:
        nonlocal released
        if not released:
            released = True
            with contextlib.suppress(StorageError):  # Redis away: the place lapses with its TTL
                await svc.index.release_inflight(tenant.name, token)

    return release


def _check_messages(body: dict[str, Any], limit: int) -> list[dict[str, Any]]:
    """`messages` as a list of objects with a string role, at most `limit` of them (400 otherwise)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise BadRequest("'messages' must be a list", param="messages")
    if len(messages) > limit:
        raise BadRequest(f"'messages' has {len(messages)} messages; the limit is {limit}", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            where = f"messages[{i}]"
            raise BadRequest(f"'{where}' must be an object with a string 'role'", param=where)
    return messages


async def _model(svc: Services, tenant: Tenant, body: dict[str, Any]) -> str:
    requested = body.get("model")
    if not isinstance(requested, str) or not requested:
        raise BadRequest("'model' is required", param="model")
    model = tenant.model_id(requested, await svc.cluster.models())
    if model is not None:
        return model
    configured = await svc.cluster.configured_models()
    if configured is None or tenant.model_id(requested, configured) is not None:
        # A node runs it but no engine of it is ready (restarting after a crash, still loading), or a
        # node did not answer and it may be one of its models.
        raise Unavailable(f"the model {requested!r} is not ready; retry", retry_after=2, param="model")
    raise NotFound(f"the model {requested!r} does not exist", param="model")


def _headers(turn: Turn) -> dict[str, str]:
    return {"X-Session-Id": turn.session, "X-Slotkeeper-Cache": turn.placement.serve.value}


async def _turn(request: Request, path: str) -> Response:
    svc: Services = request.app.state.services
    tenant = _tenant(request)
    body = await _json(request)
    await _rate_limit(svc, tenant)
    model = await _model(svc, tenant, body)
    messages = _check_messages(body, svc.settings.max_messages) if path == "/v1/chat/completions" else []
    release = await _admit(svc, tenant)
    try:
        return await _run_turn(svc, request, tenant, body, model, messages, path, release)
    except BaseException:
        await release()
        raise


async def _run_turn(
    svc: Services,
    request: Request,
    tenant: Tenant,
    body: dict[str, Any],
    model: str,
    messages: list[dict[str, Any]],
    path: str,
    release: Callable[[], Awaitable[None]],
) -> Response:
    """Resolve, place and forward one turn. A plain response releases the tenant's in-flight place
    before returning; a stream hands it (with the session bookkeeping) to its body's end."""
    session, source = await svc.runner.resolve(tenant, request.headers, body, model)
    turn = await svc.runner.begin(tenant, session, model, source)
    upstream = {k: v for k, v in body.items() if k not in ("prompt_cache_key", "id_slot")}
    upstream.update(model=model, id_slot=turn.placement.slot, cache_prompt=True)
    svc.metrics.served.labels(turn.placement.serve.value).inc()
    url = turn.engine_url.rstrip("/") + path
    t0 = time.perf_counter()
    if not body.get("stream"):
        outcome = TurnOutcome()
        try:
            payload, outcome = await forward_json(svc.http, url, upstream)
        except ApiError as exc:
            outcome.error = exc.message
            await svc.runner.finish(turn, messages, outcome)
            raise
        svc.metrics.ttft.observe(time.perf_counter() - t0)
        svc.metrics.turn_served(turn.placement.serve.value, outcome.timings)
        await svc.runner.finish(turn, messages, outcome)
        await release()
        return JSONResponse(payload, headers=_headers(turn))
    try:
        relay = await StreamRelay.open(svc.http, url, upstream)
    except ApiError as exc:
        await svc.runner.finish(turn, messages, TurnOutcome(error=exc.message))
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
            done = asyncio.create_task(_settle(svc, turn, messages, relay.outcome, release))
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(done)

    return StreamingResponse(relayed(), media_type="text/event-stream", headers=_headers(turn))


async def _settle(
    svc: Services,
    turn: Turn,
    messages: list[dict[str, Any]],
    outcome: TurnOutcome,
    release: Callable[[], Awaitable[None]],
) -> None:
    try:
        await svc.runner.finish(turn, messages, outcome)
    finally:
        await release()


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
    if not is_expected(exc):
        log.exception("gateway.unhandled", path=request.url.path)
    return render_error(api_error(exc))


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
        # The expected errors by class: Starlette's catch-all `Exception` handler re-raises after
        # answering (uvicorn then logs a traceback and drops the connection), so it is for bugs only.
        exception_handlers={e: _on_error for e in (ApiError, StorageError, HTTPException, Exception)},
        middleware=[Middleware(RequestCounter, metrics=metrics, routes=routes)],
    )

"""The node API's routes: edges that read a request, call the node agent (`engine_pool.pool.agent`)
and render its answer in the node protocol's types (`engine_pool.protocol.node`). Every error
leaves through `render_error`; everything but `/health` requires the internal credential.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import structlog
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine_pool.errors import (
    ApiError,
    BadRequest,
    NotFound,
    api_error,
    error_payload,
    is_expected,
    render_error,
)
from engine_pool.http.body import Body, parse_json_object, read_json
from engine_pool.http.credentials import RequireKey
from engine_pool.http.disconnect import unless_caller_leaves
from engine_pool.http.reports import Reports, leave_running
from storage.errors import StorageError
from storage.ids import SlotRef, validate_id
from storage.index.prefix_digests import STORED_ROUTES

from ..protocol.handoff import HANDOFF_MEDIA, PREFILL, HandoffRequest
from ..protocol.node import (
    ENGINES,
    FILL_LINES,
    HEALTH,
    METRICS,
    SESSION,
    SLOT_OPERATION,
    SLOT_OPS,
    UNSTORED,
    EngineList,
    FillProgress,
    FillRequest,
    ForgetResult,
    NodeEngine,
    NodeHealth,
    SlotResult,
    SpillRequest,
    UnstoredList,
)
from .agent import NodeAgent
from .handoff_peer import exported_frames, nothing_more, read_head, receive_carried
from .handoff_store import export
from .supervisor import EngineSnapshot

log = structlog.get_logger("engine.node")
PUBLIC_PATHS = frozenset({HEALTH})  # probes; nothing a tenant sent


def agent(request: Request) -> NodeAgent:
    a: NodeAgent = request.app.state.agent
    return a


async def health(request: Request) -> Response:
    """200 ok, or 503 while draining (a load balancer stops sending work), same body shape."""
    a = agent(request)
    if a.draining:
        retry = str(a.settings.retry_after_s)
        body = NodeHealth("draining", a.settings.node_id).to_json()
        return JSONResponse(body, status_code=503, headers={"Retry-After": retry})
    return JSONResponse(NodeHealth("ok", a.settings.node_id).to_json())


def _engine_view(snap: EngineSnapshot) -> NodeEngine:
    return NodeEngine(
        snap.engine_id,
        snap.model_id,
        snap.url,
        str(snap.state),
        snap.n_slots,
        snap.restarts,
        snap.pid,
        instance=snap.instance,
        error=snap.error,
        last_error=snap.last_error,
        role=snap.role,
    )


async def engines(request: Request) -> Response:
    a = agent(request)
    views = tuple(_engine_view(sup.snapshot()) for sup in a.engines.values())
    return JSONResponse(EngineList(a.settings.node_id, views).to_json())


async def metrics(request: Request) -> Response:
    a = agent(request)
    body = a.metrics.render(
        (sup.snapshot() for sup in a.engines.values()),
        a.parts.cache.total_bytes,
        len(a.parts.cache.pending()),
        a.parts.cache.pending_bytes(),
        a.restores,
    )
    return Response(body, media_type=CONTENT_TYPE_LATEST)


async def slot_operation(request: Request) -> Response:
    a, p = agent(request), request.path_params
    op = p["op"]
    if op not in SLOT_OPS:
        raise NotFound(f"no such slot operation {op!r} ({', '.join(SLOT_OPS)})")
    result: SlotResult
    if op == "spill":
        spill = SpillRequest.from_body(await read_json(request))
        ref = SlotRef(spill.tenant, spill.session, spill.generation)
        if spill.route and not STORED_ROUTES.fullmatch(spill.route):
            raise BadRequest(
                "'route' must be lowercase hex digests of 16..128 characters "
                "(route[.shared][+prompt][-head])",
                param="route",
            )
        result = await a.operation(
            op, p["engine"], p["slot"], ref, route=spill.route, share=spill.share, fenced=spill.fenced
        )
    elif op == "handoff":
        handoff = HandoffRequest.from_body(await read_json(request))
        validate_id(handoff.tenant, "tenant")
        validate_id(handoff.session, "session")
        if handoff.carry_from:
            validate_id(handoff.carry_from, "carry_from")
        # The gateway's client gone (its call to this node closed): the prefill is cancelled.
        operation = a.handoff(p["engine"], p["slot"], handoff)
        done = await unless_caller_leaves(
            request, operation, "the caller disconnected; the operation was cancelled", settle=True
        )
        return JSONResponse(done.to_json())
    elif op == "fill":
        fill = FillRequest.from_body(await read_json(request))
        ref = SlotRef(fill.tenant, fill.session, fill.generation)
        if fill.progress:
            return await _fill_reported(a, p["engine"], p["slot"], ref, fill)
        result = await a.operation(op, p["engine"], p["slot"], ref, tokens=fill.tokens, prefix=fill.prefix)
    else:
        result = await a.operation(op, p["engine"], p["slot"], None)
    return JSONResponse(result.to_json())


async def _fill_reported(a: NodeAgent, engine: str, slot: str, ref: SlotRef, fill: FillRequest) -> Response:
    """A fill that reports its progress (`FillRequest.progress`): its `FILL_LINES` once it sent its
    first report; a fill that ended before that is answered as one that reports nothing. The fill
    goes on when the caller leaves mid-stream, as one that reports nothing does."""
    reports: Reports[FillProgress] = Reports()
    task = asyncio.ensure_future(
        a.operation("fill", engine, slot, ref, tokens=fill.tokens, prefix=fill.prefix, progress=reports.send)
    )
    try:
        first = await reports.first(task)
    except BaseException:
        task.cancel()
        raise
    if first is None:
        return JSONResponse(task.result().to_json())

    async def lines() -> AsyncIterator[bytes]:
        try:
            yield _line({"progress": first.to_json()})
            async for report in reports.rest(task):
                yield _line({"progress": report.to_json()})
            try:
                yield _line({"result": task.result().to_json()})
            except Exception as exc:  # (the status it would have answered, and the common body)
                err = _answered(exc)
                failed = {"status": err.status, **error_payload(err)}
                if err.retry_after is not None:
                    failed["retry_after"] = err.retry_after
                yield _line(failed)
        finally:
            leave_running(task)

    return StreamingResponse(lines(), media_type=FILL_LINES)


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


async def prefill(request: Request) -> Response:
    """Another node's handoff (engine_pool.pool.handoff_peer): a frame in — the `HandoffRequest`'s
    JSON line, then a carried state's slot file when `carry` — and a frame out: `Prefilled`'s JSON
    line, then the exported slot file; with `to_store`, the file goes to that store object instead
    and the answer is `Prefilled` alone (engine_pool.pool.handoff_store). Cancelled on the prefill
    engine when the caller leaves."""
    a, engine = agent(request), request.path_params["engine"]
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != HANDOFF_MEDIA:
        raise BadRequest(f"the body must be a {HANDOFF_MEDIA} frame, not {media or 'untyped'}")
    head, rest = await read_head(request.stream())
    req = HandoffRequest.from_body(Body(parse_json_object(head)))
    validate_id(req.tenant, "tenant")
    validate_id(req.session, "session")
    if req.prefill_node:
        raise BadRequest("a prefill is not sent on to a third node", param="prefill_node")
    if req.from_store:
        raise BadRequest("'from_store' belongs to a handoff, not a prefill request", param="from_store")
    engine_sup = a.prefill_engine(engine, req.model)  # (404, 400, 503 before the carried state is read)
    carried = await receive_carried(rest, engine_sup) if req.carry else None
    if carried is None:
        await nothing_more(rest)
    name = f"handoff-{uuid.uuid4().hex}.slot"
    try:
        done = await unless_caller_leaves(
            request,
            a.prefill(engine, req, carried, name),
            "the caller disconnected; the prefill was cancelled",
            settle=True,
        )
        if req.to_store:  # through the store: the answer is the account alone
            await export(a.parts.store, req.to_store, engine_sup.spec.slot_dir / name)
            await asyncio.to_thread((engine_sup.spec.slot_dir / name).unlink)
            return JSONResponse(done.to_json())
        frames, close = await exported_frames(done, engine_sup.spec.slot_dir / name)
    except BaseException:
        await asyncio.to_thread((engine_sup.spec.slot_dir / name).unlink, missing_ok=True)
        raise
    finally:
        if carried is not None:
            await asyncio.to_thread(carried.unlink, missing_ok=True)
    return StreamingResponse(frames, media_type=HANDOFF_MEDIA, background=BackgroundTask(close))


async def handle_error(request: Request, exc: Exception) -> Response:
    return render_error(_answered(exc))


def _answered(exc: Exception) -> ApiError:
    """The error ``exc`` is answered as; logged with its traceback when it is not an expected one."""
    err = api_error(exc)
    if not is_expected(exc):
        log.error("http.unhandled", error=err.message, exc_info=exc)
    return err


async def forget_session(request: Request) -> Response:
    """Drop every copy of a session this node holds: its spill-cache files, pending uploads included
    (the gateway deletes the session; a pending upload flushed later would bring it back)."""
    a, p = agent(request), request.path_params
    tenant, session = validate_id(p["tenant"], "tenant"), validate_id(p["session"], "session")
    dropped = await a.forget(tenant, session)
    return JSONResponse(ForgetResult(tenant, session, dropped).to_json())


async def unstored(request: Request) -> Response:
    """The spill cache's generations the store does not hold yet (UnstoredList); ``?tenant=&session=``
    (both or neither): one session's only."""
    a, q = agent(request), request.query_params
    tenant, session = q.get("tenant"), q.get("session")
    if (tenant is None) != (session is None):
        raise BadRequest(
            "'tenant' and 'session' go together", param="session" if session is None else "tenant"
        )
    if tenant is not None:
        tenant, session = validate_id(tenant, "tenant"), validate_id(session, "session")
    copies = await a.unstored(tenant, session)
    return JSONResponse(UnstoredList(a.settings.node_id, tuple(copies)).to_json())


def build_node_app(lifespan: Any, internal_key: str | None) -> Starlette:
    """The node API; `lifespan` creates the parts and the agent and puts it in `app.state.agent`.
    Everything but `/health` requires `internal_key` (see engine_pool.http.credentials)."""
    app = Starlette(
        routes=[
            Route(HEALTH, health, methods=["GET"]),
            Route(ENGINES, engines, methods=["GET"]),
            Route(METRICS, metrics, methods=["GET"]),
            Route(SLOT_OPERATION, slot_operation, methods=["POST"]),
            Route(PREFILL, prefill, methods=["POST"]),
            Route(SESSION, forget_session, methods=["DELETE"]),
            Route(UNSTORED, unstored, methods=["GET"]),
        ],
        lifespan=lifespan,
        exception_handlers={e: handle_error for e in (ApiError, StorageError, HTTPException, Exception)},
    )
    if internal_key:
        app.add_middleware(RequireKey, key=internal_key, public=PUBLIC_PATHS)
    return app

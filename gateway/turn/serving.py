"""One turn's path through the gateway, for any of its APIs: admit it, run it on its session, answer.

Every API (Chat Completions, Completions, Responses, Anthropic Messages) is one chat turn on the
engines: a `Dialect` says how its request becomes the engine's chat body and how the engine's
answer (JSON or stream chunks) becomes that API's answer. Chat and completions pass through
unchanged (byte for byte when streamed). The session machinery — resolution, locks, placement,
restore, write-behind saves (gateway.turn.runner) — is the same for all, so an Anthropic or Responses
client resumes its session without re-prefill exactly like a chat client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine_pool.common.errors import (
    ApiError,
    BadRequest,
    ClientGone,
    ServerError,
    Unavailable,
    slot_changed,
)
from engine_pool.protocol.field_names import renamed
from engine_pool.protocol.report import SERVED
from engine_pool.protocol.sse import NamedEvent
from engine_pool.protocol.volatile import apply_rules
from gateway.access_log import note
from gateway.services import Services
from gateway.tenants import Tenant
from gateway.turn.early import EarlyCall, EarlyStart
from gateway.turn.engine_call import (
    CHAT_PATH,
    StreamRelay,
    TurnOutcome,
    engine_body,
    forward_json,
    refused_unrun,
)
from gateway.turn.parts import Turn
from gateway.turn.prompt import Prompt
from gateway.turn.slot_choice import Placement, Serve
from storage.errors import StorageError

T = TypeVar("T")
BRANCH_HEADER = "X-Slotkeeper-Branch-Of"


class Dialect(Protocol):
    """How one API's turn maps onto the engine's chat completions (None: passed through as is)."""

    async def answer(self, payload: dict[str, Any], turn: Turn) -> dict[str, Any]:
        """The API's answer for the engine's JSON answer (and what the API keeps of it, stored
        before the answer goes out)."""
        ...

    def stream(self, chunks: AsyncIterator[dict[str, Any]], turn: Turn) -> AsyncIterator[bytes]:
        """The API's event stream for the engine's chunks (an `{"error": ...}` chunk ends it)."""
        ...


class ClientStream(Protocol):
    """A client API's stream translator (`engine_pool.protocol`'s `MessageStream`, `ResponseStream`)."""

    def feed(self, chunk: dict[str, Any]) -> list[NamedEvent]: ...
    def finish(self) -> list[NamedEvent]: ...
    def failed(self, err: ApiError) -> list[NamedEvent]: ...


async def client_events(
    events: ClientStream, chunks: AsyncIterator[dict[str, Any]]
) -> AsyncGenerator[NamedEvent, None]:
    """The client API's events for the engine's chunks; an `{"error": ...}` chunk ends them with the
    API's failure events, and a stream that ended without its usage chunk is closed by `finish`."""
    async for chunk in chunks:
        if "error" in chunk:
            for event in events.failed(stream_failure(chunk)):
                yield event
            return
        for event in events.feed(chunk):
            yield event
    for event in events.finish():
        yield event


def stream_failure(chunk: dict[str, Any]) -> ServerError:
    """The error an engine chunk reported mid-stream, to be rendered in the client's API shape."""
    err = chunk.get("error")
    if not isinstance(err, dict):
        err = {}
    return ServerError(str(err.get("message") or "the engine failed mid-stream"))


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, unless the client disconnects first: then `work` is cancelled (closing its
    engine connection, which is how the engine learns to stop generating: a non-streamed answer
    nobody waits for must not keep a slot busy) and ClientGone is raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone("the client disconnected; the turn was cancelled")
    finally:
        gone.cancel()
        task.cancel()  # (no-op once done) its cancellation closes the engine connection


async def _disconnected(request: Request) -> None:
    # The body was read whole before the turn: the next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _engine_fields(
    body: dict[str, Any],
    tenant: Tenant,
    session: str,
    model: str,
    placement: Placement | EarlyStart,
    rules: list[str],
    cap: int = 0,
    own_restore: bool = False,
) -> dict[str, Any]:
    """The gateway's fields over the tenant's: the slot, and the slots its prompt may start from
    (the tenant's own on that engine, and only while they still are: `slot_owner`), are never
    theirs to choose. `slot_session` labels the slot with the session (gateway.healing reads the
    labels back when the index is lost); a turn on its live slot, or on its own state just restored,
    also says the slot must hold the session already (`slot_expect`: a restarted engine's slot, or
    one another placement took meanwhile, is refused with 409 slot_changed, and the turn is placed
    again)."""
    prefix = placement.prefix_slots if isinstance(placement, Placement) else ()
    context: dict[str, Any] = {"served": served_as(placement)}
    if rules:
        context["rules"] = rules
    fields: dict[str, Any] = {
        "id_slot": placement.slot,
        "model": model,
        "cache_prompt": True,
        "prefix_slots": list(prefix),
        "slot_owner": tenant.name,
        "slot_session": session,
        "slotkeeper": context,
    }
    if holds_own_state(placement, own_restore):
        fields["slot_expect"] = session
    elif "slot_expect" in body:
        fields["slot_expect"] = None
    if "prompt_cache_key" in body:
        fields["prompt_cache_key"] = None  # (the gateway's: it named the session)
    if cap:  # the engine takes it only when the request set no max_tokens (nor an alias of it)
        fields["max_tokens_default"] = cap
    return fields


def holds_own_state(placement: Placement | EarlyStart, own_restore: bool) -> bool:
    """Whether the turn's slot holds its session's own state, labelled so, before it runs: its live
    slot, or — ``own_restore`` — its own stored state restored there (the node labels the slot
    with it; a fork restores its parent's)."""
    if not isinstance(placement, Placement):
        return True  # an early start goes to the session's own slot
    return placement.serve is Serve.LIVE or (placement.serve is Serve.RESTORE and own_restore)


def served_as(placement: Placement | EarlyStart) -> str:
    """How the gateway served the session, as `X-Slotkeeper-Cache` and `slotkeeper.served` say
    it: its live slot, its own stored state, the live slot of the session holding its shared prefix
    (or of the parent it forks) on the same engine, that session's stored prefix, or nothing."""
    if not isinstance(placement, Placement):
        return Serve.LIVE.value  # an early start goes to the session's own slot
    if placement.serve is Serve.COLD and placement.prefix_from is not None:
        return "stored-prefix" if placement.prefix_stored else "prefix"
    return placement.serve.value


def session_headers(turn: Turn, report: Mapping[str, Any] | None = None) -> dict[str, str]:
    """`X-Session-Id`, and `X-Slotkeeper-Cache`: how the session was served — the engine's word when
    its answer is in hand (`report`: a slot of the tenant it started from is `prefix`); for a new
    branch of a session, or a fork of a busy one, `X-Slotkeeper-Branch-Of` names the session it
    started from (gateway.turn.branch)."""
    served = (report or {}).get("served")
    if not isinstance(served, str) or served not in SERVED:
        served = served_as(turn.placement)
    headers = {"X-Session-Id": turn.session, "X-Slotkeeper-Cache": served}
    if turn.forked_from is not None:
        headers[BRANCH_HEADER] = turn.forked_from
    return headers


def normalised(
    svc: Services, tenant: Tenant, body: dict[str, Any], messages: list[dict[str, Any]], raw: bytes | None
) -> tuple[dict[str, Any], list[dict[str, Any]], bytes | None, list[str]]:
    """The request with the tenant's volatile-block rules applied (engine_pool.protocol.volatile):
    the same objects when none matched (the tenant's bytes are sent on), else new ones (encoded
    again), and the names of the rules that changed it (counted)."""
    if not tenant.volatile:
        return body, messages, raw, []
    changed, hits = apply_rules(messages, tenant.volatile)
    if not hits:
        return body, messages, raw, []
    for name in hits:
        svc.metrics.volatile_blocks.labels(name).inc()
    return {**body, "messages": changed}, changed, None, hits


async def serve_turn(
    request: Request,
    tenant: Tenant,
    body: dict[str, Any],
    model: str,
    messages: list[dict[str, Any]],
    path: str,
    *,
    dialect: Dialect | None = None,
    session: tuple[str, str] | None = None,
    raw: bytes | None = None,
) -> Response:
    """Admit, run and answer one turn. `body` is the engine's request body (chat completions, or
    completions when `path` says so), `raw` the tenant's bytes it was parsed from when it is theirs
    as it came (sent on without encoding it again); `session` is (id, how it was found) when the
    caller already knows it (a `previous_response_id`), else the usual resolution runs. The
    bookkeeping after the answer runs beside sending it (`TurnRunner.finish_soon`)."""
    svc: Services = request.app.state.services
    note(request, tenant=tenant.name)
    body, messages, raw, rules = normalised(svc, tenant, body, messages, raw)
    # Its digests, computed once: for routing, branching, a restore cut at its checkpoint, bookkeeping.
    prompt = Prompt(messages, model, body, body.get("tools")) if path == CHAT_PATH else None
    found = session or await svc.runner.resolve(tenant, request.headers, body, prompt)
    asked = _TurnRequest(svc, tenant, body, model, messages, path, dialect, raw, rules, prompt)
    try:
        return await _serve_once(request, asked, *found)
    except _SlotChanged:  # its record placed it in a slot that holds another's state: once more
        pass
    try:  # (a restore there is not checked: a node of the previous release labels no restore)
        return await _serve_once(request, asked, *found, check_restore=False)
    except _SlotChanged:
        raise Unavailable(
            "the session's slot changed hands while it was placed; retry", retry_after=1
        ) from None


class _SlotChanged(Exception):
    """The engine refused a turn on the session's live slot (SlotChanged); its record now says it is
    stored (or new), and the turn may be placed again."""


@dataclass(frozen=True)
class _TurnRequest:
    """What one turn request serves, whichever attempt serves it (`serve_turn`)."""

    svc: Services
    tenant: Tenant
    body: dict[str, Any]
    model: str
    messages: list[dict[str, Any]]
    path: str
    dialect: Dialect | None
    raw: bytes | None
    rules: list[str]
    prompt: Prompt | None


async def _serve_once(
    request: Request, asked: _TurnRequest, session_id: str, source: str, *, check_restore: bool = True
) -> Response:
    svc, tenant, body, model, path = asked.svc, asked.tenant, asked.body, asked.model, asked.path
    messages, dialect, raw, rules, prompt = (
        asked.messages,
        asked.dialect,
        asked.raw,
        asked.rules,
        asked.prompt,
    )
    streamed = bool(body.get("stream"))
    cap = svc.settings.default_max_tokens if tenant.default_max_tokens is None else tenant.default_max_tokens
    early: EarlyCall[Any] | None = None

    def launch(where: EarlyStart) -> EarlyCall[Any]:
        url = where.url.rstrip("/") + path
        data = engine_body(raw, body, _engine_fields(body, tenant, session_id, model, where, rules, cap))
        if streamed:
            return EarlyCall(StreamRelay.open(svc.engines, url, data, where.headers()), StreamRelay.close)
        return EarlyCall(forward_json(svc.engines, url, data, where.headers()))

    opening = await svc.runner.open(tenant, session_id, model, prompt)
    try:  # sent to its slot before the opening read when the opening says it may be (gateway.turn.early)
        early = launch(opening.early) if opening.early is not None else None
    except BaseException:
        await svc.runner.abandon(opening)
        raise
    try:
        turn = await svc.runner.begin(opening, source, prompt)
    except BaseException:
        if early is not None:
            early.discard()
            svc.metrics.early_starts.labels("abandoned").inc()
        raise
    if early is not None and not turn.early:  # the opening read did not confirm it: as if never made
        early.discard()
        svc.metrics.early_starts.labels("abandoned").inc()
        early = None
    own = check_restore and turn.forked_from is None  # a restore of its own state, labelled with it
    fields = _engine_fields(body, tenant, turn.session, model, turn.placement, rules, cap, own)
    data = engine_body(raw, body, fields)
    svc.metrics.served.labels(served_as(turn.placement)).inc()
    url = turn.engine_url.rstrip("/") + path
    t0 = early.started if early is not None else time.perf_counter()

    def counted(refused: bool) -> None:
        svc.metrics.early_starts.labels("refused" if refused else "answered").inc()

    if not streamed:

        async def forwarded() -> tuple[dict[str, Any], TurnOutcome]:
            if early is not None:
                result, refused = await early.result(lambda: forward_json(svc.engines, url, data))
                counted(refused)
                return result
            return await forward_json(svc.engines, url, data)

        outcome = TurnOutcome()
        try:
            payload, outcome = await unless_client_leaves(request, forwarded())
            answer = await dialect.answer(payload, turn) if dialect else None
        except (ApiError, StorageError) as exc:
            outcome.refused = not outcome.ok and refused_unrun(exc)  # (not: answered, then not stored)
            outcome.ok = False
            outcome.error = str(exc)
            if slot_changed(exc):
                outcome.moved = True
                await svc.runner.finish_now(turn, messages, outcome)
                raise _SlotChanged() from exc
            svc.runner.finish_soon(turn, messages, outcome)
            raise
        except BaseException:  # cancelled (the client went away): the session must not stay locked
            svc.runner.finish_soon(turn, messages, TurnOutcome(error="cancelled"))
            raise
        svc.metrics.ttft.observe(time.perf_counter() - t0)
        note(request, tokens=outcome.tokens)
        headers = session_headers(turn, outcome.report)
        svc.metrics.turn_served(tenant.name, headers["X-Slotkeeper-Cache"], outcome.timings)
        svc.runner.finish_soon(turn, messages, outcome)
        if answer is None:  # passed through: the engine's bytes, not encoded again
            return Response(outcome.body, media_type="application/json", headers=headers)
        return JSONResponse(answer, headers=headers)
    try:
        if early is not None:
            relay, refused = await early.result(lambda: StreamRelay.open(svc.engines, url, data))
            counted(refused)
        else:
            relay = await StreamRelay.open(svc.engines, url, data)
    except BaseException as exc:
        failed = TurnOutcome(
            error=getattr(exc, "message", "cancelled"), moved=slot_changed(exc), refused=refused_unrun(exc)
        )
        if failed.moved:
            await svc.runner.finish_now(turn, messages, failed)
            raise _SlotChanged() from exc
        svc.runner.finish_soon(turn, messages, failed)
        raise
    svc.metrics.ttft.observe(time.perf_counter() - t0)

    async def relayed() -> AsyncIterator[bytes]:
        try:
            if dialect is None:
                async for raw in relay.chunks():
                    yield raw
            else:
                async for data in dialect.stream(relay.events(), turn):
                    yield data
        finally:
            # Also when the client went away mid-stream: the session must not stay locked.
            served = session_headers(turn, relay.outcome.report)["X-Slotkeeper-Cache"]
            note(request, tokens=relay.outcome.tokens)
            svc.metrics.turn_served(tenant.name, served, relay.outcome.timings)
            svc.runner.finish_soon(turn, messages, relay.outcome)

    async def settle() -> None:
        # A client that leaves before the body is first iterated never runs `relayed`'s `finally`
        # (an unstarted generator is not finalized); the response's background still runs.
        svc.runner.finish_soon(turn, messages, relay.outcome)

    return StreamingResponse(
        relayed(),
        media_type="text/event-stream",
        headers=session_headers(turn),
        background=BackgroundTask(settle),
    )


async def serve_client_turn(
    request: Request,
    tenant: Tenant,
    chat: dict[str, Any],
    model: str,
    messages: list[dict[str, Any]],
    dialect: Dialect,
    fields: Mapping[str, str],
    session: tuple[str, str] | None = None,
) -> Response:
    """A client API's request (Messages, Responses) translated to `chat` and served as a chat turn
    answered in its `dialect`. The engine's chat path names its own fields in a 400: the client's
    names (`fields`, engine -> client) replace them."""
    try:
        return await serve_turn(
            request, tenant, chat, model, messages, CHAT_PATH, dialect=dialect, session=session
        )
    except BadRequest as err:
        raise renamed(err, fields) from None

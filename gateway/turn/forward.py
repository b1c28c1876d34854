"""The forward step: the turn's body sent to its engine slot, and the engine's answer passed on in the
client's API — as JSON (`answer_json`) or as a stream (`answer_stream`) — with the turn ended
exactly once whichever way it goes (`Ending`).

The body goes as the tenant sent it with the gateway's fields appended (`engine_fields`): the slot,
the slots its prompt may start from, the slot's label; a turn on its own state says the slot must
hold it already (else the engine answers 409 slot_changed and the turn is placed again:
`SlotChanged`). A call the opening started early (gateway.turn.early) is awaited in place of the
ordinary one, and made again as that one when the engine refuses it as meant for an earlier process.
Chat and completions pass through unchanged (byte for byte when streamed); Messages and Responses
go through their `Dialect`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, TypedDict, TypeVar

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine_pool.errors import ApiError, ServerError, slot_changed
from engine_pool.http.disconnect import unless_caller_leaves
from engine_pool.protocol.anthropic_messages import MessageObject
from engine_pool.protocol.openai_responses import ResponseObject
from engine_pool.protocol.report import SERVED, CallerContext
from engine_pool.protocol.sse import NamedEvent
from gateway.access_log import note
from gateway.services import Services
from gateway.tenants import Tenant
from gateway.turn.early import EarlyCall, EarlyStart
from gateway.turn.engine_call import StreamRelay, TurnOutcome, engine_body, forward_json, refused_unrun
from gateway.turn.parts import Turn
from gateway.turn.prompt import Prompt
from gateway.turn.slot_choice import Placement, Serve
from storage.errors import StorageError

T = TypeVar("T")
BRANCH_HEADER = "X-Slotkeeper-Branch-Of"


# A client API's answer: what a `Dialect` makes of the engine's (the engine's JSON as it came: a
# type would be no check, and the translations read it through `chat_result`).
ClientAnswer = ResponseObject | MessageObject


class Dialect(Protocol):
    """How one API's turn maps onto the engine's chat completions (None: passed through as is)."""

    async def answer(self, payload: Mapping[str, Any], turn: Turn) -> ClientAnswer:
        """The API's answer for the engine's JSON answer (and what the API keeps of it, stored
        before the answer goes out)."""
        ...

    def stream(self, chunks: AsyncIterator[Mapping[str, Any]], turn: Turn) -> AsyncIterator[bytes]:
        """The API's event stream for the engine's chunks (an `{"error": ...}` chunk ends it)."""
        ...


class ClientStream(Protocol):
    """A client API's stream translator (`engine_pool.protocol`'s `MessageStream`, `ResponseStream`)."""

    def feed(self, chunk: Mapping[str, Any]) -> list[NamedEvent]: ...
    def finish(self) -> list[NamedEvent]: ...
    def failed(self, err: ApiError) -> list[NamedEvent]: ...


async def client_events(
    events: ClientStream, chunks: AsyncIterator[Mapping[str, Any]]
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


def stream_failure(chunk: Mapping[str, Any]) -> ServerError:
    """The error an engine chunk reported mid-stream, to be rendered in the client's API shape."""
    err = chunk.get("error")
    if not isinstance(err, dict):
        err = {}
    return ServerError(str(err.get("message") or "the engine failed mid-stream"))


@dataclass(frozen=True)
class Asked:
    """What one turn request serves, whichever attempt serves it (gateway.turn.serving): the
    engine's body (`raw`: the tenant's bytes it was parsed from, when sent on as they came), the
    engine path, the tenant's volatile-block rules that changed it, and its prompt's digests."""

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

    @property
    def streamed(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def cap(self) -> int:
        """The output cap of a request that sets none (the tenant's, else the gateway's)."""
        own = self.tenant.default_max_tokens
        return self.svc.settings.default_max_tokens if own is None else own

    def fields(self, session: str, where: Placement | EarlyStart, own_restore: bool = False) -> EngineFields:
        """The gateway's fields on this turn's body in the slot ``where`` names (`engine_fields`)."""
        return engine_fields(
            self.body, self.tenant, session, self.model, where, self.rules, self.cap, own_restore
        )

    def engine_json(self, session: str, where: Placement) -> dict[str, Any]:
        """The engine's body for this turn in the slot ``where`` names, as an object (a handoff's
        prefill runs it: gateway.turn.handoff)."""
        return {**self.body, **self.fields(session, where)}

    def engine_call(self, turn: Turn, own_restore: bool) -> tuple[str, bytes]:
        """Where the placed turn's engine call goes and what it sends."""
        url = turn.engine_url.rstrip("/") + self.path
        return url, self.engine_data(turn.session, turn.placement, own_restore)

    def engine_data(self, session: str, where: Placement | EarlyStart, own_restore: bool = False) -> bytes:
        """The bytes to send the engine for this turn in the slot ``where`` names."""
        return engine_body(self.raw, self.body, self.fields(session, where, own_restore))


class EngineFields(TypedDict, total=False):
    """The gateway's fields on a turn's chat body (`engine_fields`), as the engine reads them
    (engine_pool.server.sampling); a field set to None is dropped from the tenant's body."""

    id_slot: int
    model: str
    cache_prompt: bool
    prefix_slots: list[int]
    slot_owner: str
    slot_session: str
    slotkeeper: CallerContext
    slot_expect: str | None
    prompt_cache_key: None
    max_tokens_default: int


class SlotChanged(Exception):
    """The engine refused a turn on the session's live slot (SlotChanged); its record now says it is
    stored (or new), and the turn may be placed again."""


def engine_fields(
    body: dict[str, Any],
    tenant: Tenant,
    session: str,
    model: str,
    placement: Placement | EarlyStart,
    rules: list[str],
    cap: int = 0,
    own_restore: bool = False,
) -> EngineFields:
    """The gateway's fields over the tenant's: the slot, and the slots its prompt may start from
    (the tenant's own on that engine, and only while they still are: `slot_owner`), are never
    theirs to choose. `slot_session` labels the slot with the session (gateway.healing reads the
    labels back when the index is lost); a turn on its live slot, or on its own state just restored,
    also says the slot must hold the session already (`slot_expect`: a restarted engine's slot, or
    one another placement took meanwhile, is refused with 409 slot_changed, and the turn is placed
    again)."""
    prefix = placement.prefix_slots if isinstance(placement, Placement) else ()
    context: CallerContext = {"served": served_as(placement)}
    if rules:
        context["rules"] = rules
    fields: EngineFields = {
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
    if placement.handed_off:  # the node labelled the slot with the session as it installed the state
        return True
    return placement.serve is Serve.LIVE or (placement.serve is Serve.RESTORE and own_restore)


def served_as(placement: Placement | EarlyStart) -> str:
    """How the gateway served the session, as `X-Slotkeeper-Cache` and `slotkeeper.served` say
    it: its live slot, its own stored state, the live slot of the session holding its shared prefix
    (or of the parent it forks) on the same engine, that session's stored prefix, or nothing."""
    if not isinstance(placement, Placement):
        return Serve.LIVE.value  # an early start goes to the session's own slot
    if placement.handed_off:
        return "handoff"
    if placement.serve is Serve.COLD and placement.prefix_from is not None:
        return "stored-prefix" if placement.prefix_stored else "prefix"
    return placement.serve.value


def session_headers(turn: Turn, report: Mapping[str, Any] | None = None) -> dict[str, str]:
    """`X-Session-Id`, and `X-Slotkeeper-Cache`: how the session was served — the engine's word when
    its answer is in hand (`report`: a slot of the tenant it started from is `prefix`); for a new
    branch of a session, or a fork of a busy one, `X-Slotkeeper-Branch-Of` names the session it
    started from (gateway.turn.branch)."""
    return headers_for(turn.session, turn.placement, turn.forked_from, report)


def headers_for(
    session: str,
    placement: Placement | EarlyStart,
    forked_from: str | None,
    report: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """`session_headers` of a turn of ``session`` placed as ``placement``, forked from ``forked_from``."""
    served = (report or {}).get("served")
    if not isinstance(served, str) or served not in SERVED:
        served = served_as(placement)
    headers = {"X-Session-Id": session, "X-Slotkeeper-Cache": served}
    if forked_from is not None:
        headers[BRANCH_HEADER] = forked_from
    return headers


def launch(asked: Asked, session: str, where: EarlyStart) -> EarlyCall[Any]:
    """The turn's engine call started early by its opening, in the slot ``where`` names
    (gateway.turn.early)."""
    svc, url = asked.svc, where.url.rstrip("/") + asked.path
    data = asked.engine_data(session, where)
    if asked.streamed:
        return EarlyCall(StreamRelay.open(svc.engines, url, data, where.headers()), StreamRelay.close)
    return EarlyCall(forward_json(svc.engines, url, data, where.headers()))


async def answer(
    request: Request, asked: Asked, turn: Turn, early: EarlyCall[Any] | None, own_restore: bool
) -> Response:
    """The turn's engine call and its answer, JSON or a stream as the request asked."""
    respond = answer_stream if asked.streamed else answer_json
    return await respond(request, asked, turn, early, own_restore)


class Ending:
    """The end of one placed turn, whichever path it takes: its bookkeeping (gateway.turn.close)
    started exactly once — when it answered, when it failed, when the client left, or (awaited)
    when its slot changed hands and the turn is placed again — and what an answer counts."""

    def __init__(self, request: Request, asked: Asked, turn: Turn) -> None:
        self.request, self.asked, self.turn = request, asked, turn
        self._ended = False
        asked.svc.metrics.served.labels(served_as(turn.placement)).inc()

    def _once(self) -> bool:
        ended, self._ended = self._ended, True
        return not ended

    def answered(self, outcome: TurnOutcome) -> dict[str, str]:
        """The engine answered (a stream: it ended): counted, noted, its bookkeeping beside the
        answer going out; the answer's session headers."""
        svc, turn = self.asked.svc, self.turn
        headers = session_headers(turn, outcome.report)
        if self._once():
            note(self.request, tokens=outcome.tokens)
            svc.metrics.turn_served(turn.tenant.name, headers["X-Slotkeeper-Cache"], outcome.timings)
            svc.runner.finish_soon(turn, self.asked.messages, outcome)
        return headers

    def ends(self, outcome: TurnOutcome) -> None:
        """The turn failed, was cancelled, or its client left before its stream began: its
        bookkeeping beside whatever goes out."""
        if self._once():
            self.asked.svc.runner.finish_soon(self.turn, self.asked.messages, outcome)

    async def moved(self, outcome: TurnOutcome, cause: BaseException) -> NoReturn:
        """Its slot holds another session's state: the bookkeeping written before the turn is
        placed again (it must find the record as this one leaves it)."""
        if self._once():
            await self.asked.svc.runner.finish_now(self.turn, self.asked.messages, outcome)
        raise SlotChanged() from cause


def failed(outcome: TurnOutcome, exc: BaseException) -> TurnOutcome:
    """``outcome`` (the engine's, when it answered before the turn failed) as failed with ``exc``."""
    outcome.refused = not outcome.ok and refused_unrun(exc)  # (not: answered, then not stored)
    outcome.ok, outcome.moved = False, slot_changed(exc)
    outcome.error = str(exc)
    return outcome


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, unless the client disconnects first: then `work` is cancelled (closing its
    engine connection, which is how the engine learns to stop generating: a non-streamed answer
    nobody waits for must not keep a slot busy) and ClientGone is raised."""
    return await unless_caller_leaves(request, work, "the client disconnected; the turn was cancelled")


async def answer_json(
    request: Request, asked: Asked, turn: Turn, early: EarlyCall[Any] | None, own_restore: bool
) -> Response:
    """The turn's engine call and its JSON answer, in the client's API."""
    svc, ending = asked.svc, Ending(request, asked, turn)
    url, data = asked.engine_call(turn, own_restore)
    t0 = early.started if early is not None else time.perf_counter()
    call = early.result(lambda: forward_json(svc.engines, url, data)) if early is not None else None
    outcome = TurnOutcome()
    try:
        if call is not None:
            (payload, outcome), refused = await unless_client_leaves(request, call)
            svc.metrics.early_starts.labels("refused" if refused else "answered").inc()
        else:
            payload, outcome = await unless_client_leaves(request, forward_json(svc.engines, url, data))
        answer = await asked.dialect.answer(payload, turn) if asked.dialect else None
    except (ApiError, StorageError) as exc:
        if failed(outcome, exc).moved:
            await ending.moved(outcome, exc)
        ending.ends(outcome)
        raise
    except BaseException:  # cancelled (the client went away): the session must not stay locked
        ending.ends(TurnOutcome(error="cancelled"))
        raise
    svc.metrics.ttft.observe(time.perf_counter() - t0)
    headers = ending.answered(outcome)
    if answer is None:  # passed through: the engine's bytes, not encoded again
        return Response(outcome.body, media_type="application/json", headers=headers)
    return JSONResponse(answer, headers=headers)


async def answer_stream(
    request: Request, asked: Asked, turn: Turn, early: EarlyCall[Any] | None, own_restore: bool
) -> Response:
    """The turn's engine call and its stream, in the client's API."""
    svc, ending = asked.svc, Ending(request, asked, turn)
    url, data = asked.engine_call(turn, own_restore)
    t0 = early.started if early is not None else time.perf_counter()
    try:
        if early is not None:
            relay, refused = await early.result(lambda: StreamRelay.open(svc.engines, url, data))
            svc.metrics.early_starts.labels("refused" if refused else "answered").inc()
        else:
            relay = await StreamRelay.open(svc.engines, url, data)
    except BaseException as exc:
        outcome = TurnOutcome(
            error=getattr(exc, "message", "cancelled"), moved=slot_changed(exc), refused=refused_unrun(exc)
        )
        if outcome.moved:
            await ending.moved(outcome, exc)
        ending.ends(outcome)
        raise
    svc.metrics.ttft.observe(time.perf_counter() - t0)
    dialect = asked.dialect

    async def relayed() -> AsyncIterator[bytes]:
        try:
            if dialect is None:
                async for raw in relay.chunks():
                    yield raw
            else:
                async for data in dialect.stream(relay.events(), turn):
                    yield data
        finally:  # also when the client went away mid-stream: the session must not stay locked
            ending.answered(relay.outcome)

    async def settle() -> None:
        # A client that leaves before the body is first iterated never runs `relayed`'s `finally`
        # (an unstarted generator is not finalized); the response's background still runs.
        ending.ends(relay.outcome)

    return StreamingResponse(
        relayed(),
        media_type="text/event-stream",
        headers=session_headers(turn),
        background=BackgroundTask(settle),
    )

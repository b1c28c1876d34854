"""The opening step: this process's own hold on the session taken over, the early start decided
(and the engine call started), the opening read.

The opening read (storage.index.turnops) is the turn's one Redis round trip before it runs: it
counts the request in the tenant's rate window, takes an in-flight place, takes or confirms the
session's lock and marks a live session busy in its slot. `plan` runs before it and returns an
`Opening`: the plan, including where the turn may be sent before the read returns
(`Opening.early`, gateway.turn.early); `admit` makes the read and turns a refusal into the
tenant's error (`refusal`, pure); `open_turn` is the step: both, with the early call between them.
What the reads said of each tenant's admission (`Admission`) decides whether an early start is
worth taking.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine_pool.errors import ApiError, QuotaExceeded, RateLimited
from gateway.cluster import EngineRef
from gateway.tenants import Tenant
from gateway.turn.early import EarlyCall, EarlyStart, early_start
from gateway.turn.handoff import prefill_engine, stays_whole, threshold_for
from gateway.turn.hold import SessionHold
from gateway.turn.parts import TurnParts
from storage.index.records import SessionRecord
from storage.index.turnops import TurnStart

RATE_WINDOW_S = 60  # the opening read's rate window (requests per minute)


_RATE_ROOM = 0.9  # an early start only below this share of the tenant's requests per minute


_INFLIGHT_BACKOFF_S = 1.0  # no early start for a tenant this long after an in-flight refusal


@dataclass
class Admission:
    """What this process's opening reads last said of one tenant's admission (wall-clock times)."""

    window: int = -1  # the rate window `rate` counts in (its number: floor(time / 60))
    rate: int = 0
    inflight: int = 0  # in-flight places at the last admitted read, that request's included
    refused_until: float = 0.0

    def seen(self, start: TurnStart, now: float) -> None:
        """An opening read's answer, read at ``now``."""
        window = int(now // RATE_WINDOW_S)
        if start.refused == "rate":
            self.window, self.rate = window, start.count
            self.refused_until = (window + 1) * RATE_WINDOW_S
        elif start.refused == "inflight":
            self.refused_until = max(self.refused_until, now + _INFLIGHT_BACKOFF_S)
        else:
            self.inflight = start.inflight
            if start.rate >= 0:
                self.window, self.rate = window, start.rate

    def room(self, rpm_limit: int | None, inflight_limit: int, now: float) -> bool:
        """Whether the last reads left room for one more request: the rate well below the tenant's
        requests per minute (another replica may have counted some since), a free in-flight place."""
        if now < self.refused_until:
            return False
        if rpm_limit is not None:
            rate = self.rate if self.window == int(now // RATE_WINDOW_S) else 0
            if rate + 1 > rpm_limit * _RATE_ROOM:
                return False
        return self.inflight < inflight_limit


@dataclass(frozen=True)
class Opening:
    """A turn about to make its opening read. ``own``: this process's hold on the session, taken
    over from the session's previous turn (its save still holds it); ``early``: where the caller
    may send the turn before the read returns (None: it waits for the read)."""

    tenant: Tenant
    session: str
    model: str
    inflight_limit: int
    own: SessionHold | None = None
    early: EarlyStart | None = None


@dataclass(frozen=True)
class Admitted:
    """The opening read's answer for an admitted turn, and the hold it kept (None: not ours)."""

    start: TurnStart
    own: SessionHold | None


@dataclass(frozen=True)
class Opened:
    """A turn after its opening: its plan, the read's answer, and the engine call it started early
    (None: none; the caller keeps it only once placing the turn confirmed it)."""

    opening: Opening
    admitted: Admitted
    early: EarlyCall[Any] | None = None


def refusal(tenant: Tenant, start: TurnStart, inflight_limit: int, now: float) -> ApiError | None:
    """The error for an opening read that refused the request, None when it admitted it."""
    if start.refused == "rate":
        rpm = tenant.quotas.requests_per_minute
        return QuotaExceeded(
            f"tenant {tenant.name} exceeded {rpm} requests per minute", retry_after=60 - now % 60
        )
    if start.refused == "inflight":
        return RateLimited(
            f"tenant {tenant.name} already has {inflight_limit} requests running", retry_after=1
        )
    return None


def new_session_refusal(tenant: Tenant, start: TurnStart) -> QuotaExceeded | None:
    """The error for a new session the tenant's quotas leave no room for, from the counts the
    opening read returned (O(1) each); None when there is room."""
    q = tenant.quotas
    if q.sessions is not None and start.sessions >= q.sessions:
        return QuotaExceeded(
            f"tenant {tenant.name} has reached its limit of {q.sessions} sessions", retry_after=60
        )
    if q.stored_bytes is not None and start.stored_bytes >= q.stored_bytes:
        return QuotaExceeded(
            f"tenant {tenant.name} stores {q.stored_bytes} bytes of sessions, its limit: delete sessions "
            "to start new ones",
            retry_after=60,
        )
    return None


async def open_turn(
    parts: TurnParts,
    admissions: dict[str, Admission],
    tenant: Tenant,
    session: str,
    model: str,
    goes_on: Callable[[SessionRecord | None], bool] = lambda record: True,
    launch: Callable[[EarlyStart], EarlyCall[Any]] | None = None,
    adds: Callable[[SessionRecord], int | None] = lambda record: 0,
) -> Opened:
    """The turn's opening: `plan` it, start its engine call early where the plan says it may
    (``launch``), and `admit` it (the opening read). A call started early is discarded (counted as
    abandoned) when the read refuses the turn."""
    opening = await plan(parts, admissions, tenant, session, model, goes_on, adds)
    call = None
    if opening.early is not None and launch is not None:
        try:
            call = launch(opening.early)
        except BaseException:
            await abandon(parts, opening)
            raise
    try:
        admitted = await admit(parts, admissions, opening)
    except BaseException:
        discard(parts, call)
        raise
    return Opened(opening, admitted, call)


def discard(parts: TurnParts, call: EarlyCall[Any] | None) -> None:
    """Abandon an engine call started early that the turn does not take (counted)."""
    if call is not None:
        call.discard()
        parts.metrics.early_starts.labels("abandoned").inc()


async def plan(
    parts: TurnParts,
    admissions: dict[str, Admission],
    tenant: Tenant,
    session: str,
    model: str,
    goes_on: Callable[[SessionRecord | None], bool] = lambda record: True,
    adds: Callable[[SessionRecord], int | None] = lambda record: 0,
) -> Opening:
    """Take this process's hold on the session over from its previous turn (when it has one and
    no request runs on it), and decide whether the turn may start before its opening read: only on
    such a hold, while this process's last reads of the tenant left room (`Admission.room`), only
    when the turn goes on from the state the hold's record says its slot holds (``goes_on``:
    else the turn branches, gateway.turn.branch, and its slot must not see it), and only when it
    is certainly not split (`stays_whole`, with ``adds``: the prompt tokens it adds to that state,
    at most). Hand the `Opening` to `admit`, or to `abandon` when giving up before."""
    limit = tenant.quotas.inflight or parts.settings.max_inflight
    own = parts.holds.get(tenant.name, session)
    if own is not None and not await parts.holds.take_over(own):
        own = None  # a request runs on it (forked later) or it was released (locked later)
    early = None
    try:
        if own is not None and parts.settings.early_start and goes_on(own.record):
            admission = admissions.setdefault(tenant.name, Admission())
            if admission.room(tenant.quotas.requests_per_minute, limit, time.time()):
                rec = own.record
                engine = parts.cluster.cached_engine(rec.engine) if rec is not None and rec.engine else None
                margin_s = parts.settings.lock_ttl_s / 3
                if engine is not None and rec is not None and _whole(parts, tenant, model, engine, rec, adds):
                    early = early_start(own, engine, model, time.monotonic(), margin_s=margin_s)
    except BaseException:
        if own is not None:
            await parts.holds.let_go(own, turn=True)
        raise
    return Opening(tenant, session, model, limit, own, early)


def _whole(
    parts: TurnParts,
    tenant: Tenant,
    model: str,
    engine: EngineRef,
    record: SessionRecord,
    adds: Callable[[SessionRecord], int | None],
) -> bool:
    """Whether a warm turn on ``engine`` certainly stays unsplit (gateway.turn.handoff); what the
    turn adds is counted only where a split could be (a prefill engine of the model, a threshold)."""
    threshold = threshold_for(tenant, parts.settings)
    prefill_here = prefill_engine(parts.cluster.cached_prefill_engines(model), engine.node) is not None
    added = adds(record) if prefill_here and threshold else None
    return stays_whole(threshold, added, prefill_here)


async def abandon(parts: TurnParts, opening: Opening) -> None:
    """The caller gives the turn up before `admit`: the hold it took over is let go."""
    if opening.own is not None:
        await parts.holds.let_go(opening.own, turn=True)


async def admit(parts: TurnParts, admissions: dict[str, Admission], opening: Opening) -> Admitted:
    """The opening read, and the tenant's error when it refused the request. The hold taken over
    is kept only when the read confirmed the lock; otherwise (or on any failure) it is let go."""
    tenant, own, q = opening.tenant, opening.own, opening.tenant.quotas
    admission = admissions.setdefault(tenant.name, Admission())
    try:
        async with own.writing() if own is not None else contextlib.nullcontext():
            start = await parts.index.start_turn(
                tenant.name,
                opening.session,
                lock_ttl_s=parts.settings.lock_ttl_s,
                inflight_limit=opening.inflight_limit,
                inflight_ttl_s=parts.settings.inflight_ttl_s,
                rpm_limit=q.requests_per_minute,
                own_lock=own.lock if own is not None else None,
            )
            if own is not None and start.kept:
                own.record = start.record
        admission.seen(start, time.time())
    except BaseException:
        if own is not None:
            await parts.holds.let_go(own, turn=True)
        raise
    if own is not None and not start.kept:  # refused, or its lock lapsed (the keeper says so)
        await parts.holds.let_go(own, turn=True)
        own = None
    refused = refusal(tenant, start, opening.inflight_limit, time.time())
    if refused is not None:
        raise refused
    parts.cluster.saw_epoch(start.registry_epoch)
    if parts.healing is not None:
        parts.healing.saw(start.index_epoch, start.index_built)
    return Admitted(start, own)

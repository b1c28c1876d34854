"""Admitting a turn: this process's own hold taken over, the early start decided, the opening read.

The opening read (storage.index.turnops) is the turn's one Redis round trip before it runs: it
counts the request in the tenant's rate window, takes an in-flight place, takes or confirms the
session's lock and marks a live session busy in its slot. `open_turn` runs before it and returns
an `Opening`: the plan, including where the caller may send the turn before the read returns
(`Opening.early`, gateway.turn.early); `admit` makes the read and turns a refusal into the tenant's
error (`refusal`, pure).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine_pool.common.errors import ApiError, QuotaExceeded, RateLimited
from gateway.tenants import Tenant
from gateway.turn.early import Admission, EarlyStart, early_start
from gateway.turn.hold import SessionHold
from gateway.turn.parts import TurnParts
from storage.index.records import SessionRecord
from storage.index.turnops import TurnStart


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
) -> Opening:
    """Take this process's hold on the session over from its previous turn (when it has one and
    no request runs on it), and decide whether the turn may start before its opening read: only on
    such a hold, while this process's last reads of the tenant left room (`Admission.room`), and
    only when the turn goes on from the state the hold's record says its slot holds (``goes_on``:
    else the turn branches, gateway.turn.branch, and its slot must not see it). The caller hands the
    `Opening` to `admit`, or to `abandon` when it gives up before."""
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
                early = early_start(own, engine, model, time.monotonic(), margin_s=margin_s)
    except BaseException:
        if own is not None:
            await parts.holds.let_go(own, turn=True)
        raise
    return Opening(tenant, session, model, limit, own, early)


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

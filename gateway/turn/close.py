"""Finishing a turn: the record back to idle, the routing digests, the usage counters, the
in-flight place and the lock — and, for a tenant that keeps sessions durable after every turn, a
write-behind save (gateway.turn.save).

`bookkeeping` decides what to write from the turn and what the engine answered (pure); `finish`
writes it in one round trip beside the answer going out. A fault there costs durability or routing
of this one session, never the answer already given.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from gateway.tenants import Durability
from gateway.turn.engine_call import TurnOutcome
from gateway.turn.hold import write_record
from gateway.turn.parts import Turn, TurnParts
from gateway.turn.prompt import finished_digests
from gateway.turn.save import write_behind
from storage.errors import LockLost, NotStored, StorageError, WriteConflict
from storage.index.session_index import SessionIndex
from storage.index.turnops import Ops

log = structlog.get_logger("slotkeeper.gateway")


@dataclass(frozen=True)
class Bookkeeping:
    """What finishing one turn writes besides the record going idle."""

    tokens: int | None = None  # the session's tokens now (None: unknown, kept)
    digests: tuple[str, ...] = ()  # the routes its next turn is found by (gateway.turn.prompt)
    shared: str | None = None  # its shared prefix's digest, for sessions that start from it
    identical: str | None = None  # this prompt's digest, for a new session that sends it again (a pp key)
    head: str | None = None  # this turn's head: where its next turn goes on from (gateway.turn.branch)
    usage: Mapping[str, int] = field(default_factory=dict)
    inflight: str = ""  # the tenant's in-flight place to give back
    release: bool = False  # the lock too (no save follows and no other user holds it)
    save: bool = False  # a write-behind save follows
    linger: bool = False  # no save follows, but the hold is kept a moment for a next turn (Holds.linger)

    @property
    def route(self) -> str | None:
        return self.digests[-1] if self.digests else None

    @property
    def routes(self) -> list[str]:
        """What implicit routing finds the session by from now on: its complete turns and its head
        (gateway.turn.prompt.route_lookup looks both up)."""
        return [*self.digests, self.head] if self.head else list(self.digests)

    def queue(self, index: SessionIndex, ops: Ops, tenant: str, session: str) -> None:
        """Queue the writes besides the record on the record's own round trip."""
        if self.routes or self.identical:  # kept bounded per session (storage.index.prefix_digests)
            index.queue_prefixes(ops, tenant, session, self.routes, self.identical)
        if self.shared:
            index.queue_shared(ops, tenant, session, self.shared)
        if self.usage:
            index.queue_usage(ops, tenant, dict(self.usage))
        if self.inflight:
            index.queue_release_inflight(ops, tenant, self.inflight)
        if self.release:
            ops.delete(index.keys.lock(tenant, session))


def bookkeeping(
    turn: Turn,
    messages: Sequence[Mapping[str, Any]],
    outcome: TurnOutcome,
    *,
    shares: bool,
    last_user: bool,
    linger: bool = False,
) -> Bookkeeping:
    """What to write for a finished turn: routes, shared digests and usage only when the engine
    answered; a save when the tenant keeps sessions durable after every turn; the lock released
    with the record when nothing else (a pending save) still holds it (``last_user``) — unless the
    turn answered and ``linger`` keeps the hold a moment for the session's next turn."""
    save = outcome.ok and turn.tenant.durability is Durability.AFTER_TURN
    lingers = linger and outcome.ok and not save
    release = not save and last_user and not lingers
    if not outcome.ok:
        return Bookkeeping(outcome.tokens or None, inflight=turn.inflight, release=release, save=save)
    tools = turn.prompt.tools if turn.prompt is not None else None
    digests, identical = finished_digests(messages, outcome.assistant_message(), tools, turn.model)
    usage = {
        "requests": 1,
        "prompt_tokens": int(outcome.usage.get("prompt_tokens", 0)),
        "completion_tokens": int(outcome.usage.get("completion_tokens", 0)),
    }
    return Bookkeeping(
        outcome.tokens or None,
        tuple(digests),
        turn.shared,
        identical if shares else None,
        turn.prompt.head if turn.prompt is not None else None,
        usage,
        turn.inflight,
        release,
        save,
        lingers,
    )


async def finish(
    parts: TurnParts, turn: Turn, messages: Sequence[Mapping[str, Any]], outcome: TurnOutcome
) -> None:
    """Write the turn's bookkeeping (see the module doc) and let go of its hold. Never raises."""
    t, s, hold = turn.tenant.name, turn.session, turn.hold
    if turn.created and outcome.refused:
        parts.holds.answered(hold, ())
        await _forget(parts, turn)
        return
    books = bookkeeping(
        turn,
        messages,
        outcome,
        shares=parts.shares(t),
        last_user=parts.holds.last_user(hold),
        linger=parts.settings.early_start and parts.holds.lingers and not outcome.moved,
    )
    parts.holds.answered(hold, books.routes)
    decide = parts.index.decide_idle(s, books.tokens, books.route, books.shared, books.identical, books.head)
    idle: bool | None = True
    if outcome.moved:  # its slot holds someone else's state: it is recorded as its stored state
        decide, idle = parts.index.decide_unplaced(turn.placement.engine, turn.placement.slot), None
        log.warning("session.slot_changed", tenant=t, session=s, engine=turn.placement.engine)
        parts.metrics.slot_changed.inc()
    written = released = False
    try:
        _, written = await write_record(
            parts.index, hold, decide, idle=idle, also=lambda ops: books.queue(parts.index, ops, t, s)
        )
        released = written and books.release
        if not outcome.ok:
            # A failed or timed-out request fails alone. Whether the engine died is the node's to
            # say (process exit, failed health, re-registration drop its sessions), not ours.
            log.warning("session.turn_failed", tenant=t, session=s, error=outcome.error)
        if not written:  # the record changed under us: the transaction wrote it; now the rest
            if books.routes or books.identical:
                await parts.index.add_prefixes(t, s, books.routes, books.identical)
            if books.shared:
                await parts.index.add_shared(t, s, books.shared)
            if books.usage:
                await parts.index.incr_usage(t, dict(books.usage))
        if books.save:
            parts.holds.saving(hold, functools.partial(write_behind, parts, turn))
        elif books.linger:
            parts.holds.linger(hold)
    except LockLost:
        log.warning("session.lock_lost", tenant=t, session=s)
    except (WriteConflict, NotStored):
        # The node dropped the session meanwhile (its engine died) or it was deleted: nothing to keep.
        log.info("session.gone_after_turn", tenant=t, session=s)
    except StorageError as exc:
        log.warning("session.finish_failed", tenant=t, session=s, error=str(exc))
    finally:
        if turn.inflight and not written:
            with contextlib.suppress(StorageError):
                await parts.index.release_inflight(t, turn.inflight)
        parts.holds.booked(hold)
        await parts.holds.let_go(hold, released=released)


async def _forget(parts: TurnParts, turn: Turn) -> None:
    """A session created for a turn the engine refused before running it (a malformed field, a
    prompt past the context) holds nothing: it leaves no record behind — nothing to list, nothing
    counted toward the tenant's sessions. Never raises."""
    t, s, hold = turn.tenant.name, turn.session, turn.hold
    try:
        await parts.index.delete(t, s, lock=hold.lock)
        log.debug("session.refused_unrun", tenant=t, session=s)
    except StorageError as exc:  # Redis away: the record stays, as for any failed turn
        log.warning("session.finish_failed", tenant=t, session=s, error=str(exc))
    finally:
        if turn.inflight:
            with contextlib.suppress(StorageError):
                await parts.index.release_inflight(t, turn.inflight)
        parts.holds.booked(hold)
        await parts.holds.let_go(hold)

"""Evicting an idle session from the slot a placement chose: spilled as its next stored generation.

`eviction_step` decides from the victim's record alone (pure); `evict` takes the victim's lock,
reads its record and carries the step out. Any failure costs the placing request only (503) and
leaves the victim live where it was — except a victim that was not there: deleted meanwhile, or
recorded in a slot whose label names someone else (the slot fence: its save is refused, as a turn
that failed before it ran, or a stale record, leaves). Its claim is dropped and the slot is the
placement's, its contents unknown (`evict` returns False: the slot is cleared before use).
"""

from __future__ import annotations

import contextlib
import functools
from enum import StrEnum

import structlog

from engine_pool.errors import Unavailable, slot_changed
from engine_pool.pool.client import NodeClient, NodeError
from gateway.turn.parts import TurnParts
from gateway.turn.save import save_slot
from gateway.turn.slot_choice import Placement
from storage.errors import LockBusy, NotStored, StorageError
from storage.index.records import SessionRecord

log = structlog.get_logger("slotkeeper.gateway")


class EvictionStep(StrEnum):
    MOVED = "moved"  # it left the slot while we waited for its lock: the slot no longer holds it
    RECORD = "record"  # its after-turn save is its current state: record it spilled, save nothing
    SAVE = "save"  # save the slot as its next generation, then record it spilled


def eviction_step(rec: SessionRecord, engine: str, slot: int) -> EvictionStep:
    """What evicting the session ``rec`` from (``engine``, ``slot``) takes. A session that moved
    (its own next turn took it elsewhere) is never saved from the slot: that would give it someone
    else's state."""
    if not rec.live_in(engine, slot):
        return EvictionStep.MOVED
    if rec.generation and not rec.dirty:
        return EvictionStep.RECORD
    return EvictionStep.SAVE


async def evict(parts: TurnParts, engine: str, node: NodeClient, placement: Placement) -> bool:
    """Spill the placement's victim out of its slot; False when it was not there (see the module
    doc)."""
    victim = placement.evict
    assert victim is not None and victim.tenant and victim.session
    ttl_s, spill_wait_s = parts.settings.lock_ttl_s, parts.settings.spill_wait_s
    try:  # an idle victim may still be saving its last turn: wait for that, not longer
        lock = await parts.locks.acquire(victim.tenant, victim.session, ttl_s=ttl_s, wait_s=spill_wait_s)
    except LockBusy:
        raise Unavailable("the slot chosen for eviction stayed busy; retry", retry_after=1) from None
    try:
        try:
            rec = await parts.index.get(victim.tenant, victim.session)
        except NotStored:  # deleted meanwhile: whatever it left in the slot is nobody's now
            return False
        step = eviction_step(rec, engine, victim.slot)
        if step is EvictionStep.MOVED:
            raise Unavailable("the slot chosen for eviction changed hands; retry", retry_after=1)
        out = None
        if step is EvictionStep.RECORD:
            generation, key, nbytes, tokens = rec.generation, rec.blob_key, rec.bytes, None
        else:
            reserve = functools.partial(
                parts.index.reserve_generation, victim.tenant, victim.session, lock=lock
            )
            share = parts.shares(victim.tenant)
            out = await save_slot(
                node, engine, victim.slot, victim.tenant, victim.session, rec, reserve, share
            )
            generation, key, nbytes, tokens = out.generation, out.key, out.bytes, out.tokens
        await parts.index.mark_spilled(
            victim.tenant,
            victim.session,
            generation=generation,
            blob_key=key,
            nbytes=nbytes,
            tokens=tokens,
            lock=lock,
        )
        parts.metrics.evictions.inc()
        if out is not None:
            parts.metrics.spilled("evict", out.bytes, out.ms, out.written)
        log.info(
            "session.evicted",
            tenant=victim.tenant,
            session=victim.session,
            engine=engine,
            slot=victim.slot,
            generation=generation,
            saved=out is not None,
        )
        return True
    except (NodeError, StorageError) as exc:
        if slot_changed(exc):  # the slot holds someone else's state, or nobody's: not the victim's
            unplaced = parts.index.decide_unplaced(engine, victim.slot)
            with contextlib.suppress(StorageError):
                await parts.index.transition(victim.tenant, victim.session, unplaced, lock=lock)
                parts.metrics.slot_changed.inc()
                log.warning(
                    "session.slot_changed", tenant=victim.tenant, session=victim.session, engine=engine
                )
                return False
        log.warning(
            "session.evict_failed",
            tenant=victim.tenant,
            session=victim.session,
            engine=engine,
            error=str(exc),
        )
        raise Unavailable("could not make room for this session; retry", retry_after=1) from exc
    finally:
        with contextlib.suppress(StorageError):
            await parts.locks.release(lock)

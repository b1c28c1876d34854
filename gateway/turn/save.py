"""Saving a session's slot as its next stored generation: the write-behind save after a turn, and
the save an eviction makes (gateway.turn.evict).

Which generation a save is stored as is storage.index.generations' rule, the one every saver
follows; here it is the node agent's 409 ``conflict`` that says a generation is taken.
`left_slot` decides (pure) whether a write-behind save still has its state to save.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

import structlog

from engine_pool.errors import Unavailable, slot_changed
from engine_pool.pool.client import NodeClient, NodeError
from engine_pool.protocol.node import SpillResult
from gateway.turn.hold import write_record
from gateway.turn.parts import Turn, TurnParts
from storage.blobs.blobstore import delete_generations
from storage.errors import StorageError
from storage.index.generations import GenerationsTaken, save_as_next_generation
from storage.index.records import SessionRecord

log = structlog.get_logger("slotkeeper.gateway")


def _taken(exc: Exception) -> bool:
    """The node says the generation is held already (a copy a crash left, in its cache or the store)."""
    return isinstance(exc, NodeError) and exc.status == 409 and exc.code == "conflict"


async def save_slot(
    node: NodeClient,
    engine: str,
    slot: int,
    tenant: str,
    session: str,
    rec: SessionRecord,
    reserve: Callable[[], Awaitable[int]],
    share: bool,
) -> SpillResult:
    """Save the slot as the session's next generation, a number the index hands out once per
    session id (``reserve``); ``share`` lets its stored chunks be shared with the tenant's other
    sessions. A generation the node or the store holds already is skipped for the next one, never
    overwritten (storage.index.generations). Only while the slot holds the session (its label):
    else NodeError 409 slot_changed, and nothing is saved."""

    async def spill(generation: int) -> SpillResult:
        return await node.spill(
            engine,
            slot,
            tenant=tenant,
            session=session,
            generation=generation,
            route=rec.stored_routes,
            share=share,
            fenced=True,
        )

    try:
        return await save_as_next_generation(session, reserve, spill, _taken)
    except GenerationsTaken as exc:
        raise Unavailable(str(exc), retry_after=1) from None


def left_slot(rec: SessionRecord, where: tuple[str, int]) -> bool:
    """Whether the session is no longer live in the slot ``where`` a write-behind save would save:
    the node dropped it when its engine died, and a slot of a restarted engine holds someone
    else's state."""
    return not rec.live_in(*where)


async def write_behind(parts: TurnParts, turn: Turn) -> None:
    """Save the turn's slot after its answer went out (its hold keeps the lock meanwhile); the
    newest ``keep_generations`` stay, older ones go. Never raises: the turn was answered, a failed
    save only costs durability."""
    t, s, hold = turn.tenant.name, turn.session, turn.hold
    where = (turn.placement.engine, turn.placement.slot)
    try:
        # The index, not this process's copy: the node may have dropped the session meanwhile.
        rec = await parts.index.get(t, s)
        hold.record = rec
        if left_slot(rec, where):
            return
        limit = turn.tenant.quotas.stored_bytes
        if limit is not None and await parts.index.stored_bytes(t) >= limit:
            parts.metrics.saves_skipped.labels("stored_bytes").inc()
            log.warning("session.save_skipped", tenant=t, session=s, reason="stored_bytes quota", limit=limit)
            return
        since = rec.last_used  # a turn that runs meanwhile changes it: the record stays dirty

        async def reserve() -> int:
            record, _ = await write_record(parts.index, hold, parts.index.decide_reserve(s))
            return record.reserved

        out = await save_slot(turn.node, where[0], where[1], t, s, rec, reserve, parts.shares(t))
        durable = parts.index.decide_durable(
            s, generation=out.generation, blob_key=out.key, nbytes=out.bytes, since=since, slot=where
        )
        await write_record(parts.index, hold, durable)
        parts.metrics.spilled("after-turn", out.bytes, out.ms, out.written)
        log.debug(
            "session.durable",
            tenant=t,
            session=s,
            generation=out.generation,
            bytes=out.bytes,
            written=out.written,
            uploaded=out.uploaded,
        )
        # The newest K stay (the one before may be what a fork is filling from); older ones go.
        keep = parts.settings.keep_generations
        if await delete_generations(parts.store, t, s, below=out.generation - keep + 1):
            parts.told_superseded(t)
    except Exception as exc:  # the turn was answered; a failed save only costs durability
        log.warning("session.write_behind_failed", tenant=t, session=s, error=str(exc))
        if slot_changed(exc):  # its slot holds another's state now: it is what it last stored
            with contextlib.suppress(StorageError):
                await write_record(parts.index, hold, parts.index.decide_unplaced(*where))
            parts.metrics.slot_changed.inc()

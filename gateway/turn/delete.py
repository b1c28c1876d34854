"""Deleting a session everywhere: its slot, every node's spill cache, its stored generations and
its index record. A later request with the same id starts a new session (storage.index keeps the
id's generation floor, so no leftover copy is mistaken for the new one's)."""

from __future__ import annotations

import contextlib

import structlog

from engine_pool.errors import Conflict, NotFound, Unavailable
from engine_pool.pool.client import NodeError
from gateway.tenants import Tenant
from gateway.turn.parts import TurnParts
from storage.blobs.blobstore import delete_generations
from storage.errors import LockBusy, StorageError
from storage.index.records import SessionRecord

log = structlog.get_logger("slotkeeper.gateway")


async def delete(parts: TurnParts, tenant: Tenant, session: str) -> SessionRecord:
    """Remove every copy (see the module doc); the record as it was. 404 unknown, 409 while a
    request that did not end in time still runs on it."""
    ttl_s = parts.settings.lock_ttl_s
    rec = await parts.index.find(tenant.name, session)
    if rec is None:
        raise NotFound(f"session {session} not found")
    try:
        lock = await parts.locks.acquire(tenant.name, session, ttl_s=ttl_s)
    except LockBusy:
        # A request runs on it: whoever waits for that answer is told the session is going, so
        # its generation ends now (the turn then saves and lets go of the lock, or fails).
        await _cancel_turn(parts, rec)
        try:
            lock = await parts.locks.acquire(
                tenant.name, session, ttl_s=ttl_s, wait_s=parts.settings.spill_wait_s
            )
        except LockBusy:
            raise Conflict(f"session {session} is busy with a request; retry", retry_after=1) from None
    try:
        # Where it is now: the record read before the lock may predate an eviction, after which its
        # old slot holds another session's state.
        found = await parts.index.find(tenant.name, session)
        if found is None:
            raise NotFound(f"session {session} not found")
        rec = found
        if (place := rec.place) is not None:
            engine = await parts.cluster.engine(place[0])
            if engine is not None:
                node = await parts.node(engine.node)
                await node.erase(engine.engine, place[1])
        for node in await parts.all_nodes():
            await node.forget(tenant.name, session)
        await delete_generations(parts.store, tenant.name, session)
        await parts.index.delete(tenant.name, session, lock=lock)
        parts.told_superseded(tenant.name)
    except NodeError as exc:
        raise Unavailable(
            f"could not delete every copy of session {session}: {exc.message}", retry_after=1
        ) from exc
    finally:
        with contextlib.suppress(StorageError):
            await parts.locks.release(lock)
    log.info("session.deleted", tenant=tenant.name, session=session)
    return rec


async def _cancel_turn(parts: TurnParts, rec: SessionRecord) -> None:
    """End the generation on the session's slot, when it is live there (a session being placed
    has none yet: its turn is waited for)."""
    if (place := rec.place) is None:
        return
    engine = await parts.cluster.engine(place[0])
    if engine is None:
        return
    with contextlib.suppress(NodeError):  # (then the wait for the lock decides)
        node = await parts.node(engine.node)
        if await node.cancel(engine.engine, place[1]):
            log.info("session.turn_cancelled", tenant=rec.tenant, session=rec.session, reason="delete")

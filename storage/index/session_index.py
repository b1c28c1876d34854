"""The session index on Redis: session records, engine LRUs, stored bytes, generation floors.

Keys (see :class:`~storage.index.keyspace.Keyspace`) are namespaced by a prefix and the tenant; every
change that touches several keys — a record plus its tenant listing plus an engine's idle LRU and
live set plus the tenant's stored bytes — is one WATCH/MULTI transaction, so a reader never sees
half a transition. Writes may present a :class:`~storage.index.locks.SessionLock`; the transaction then
also proves the lock is still held (fencing), raising :class:`LockLost` otherwise.

Invariants kept by :meth:`SessionIndex._change` for every transition:

* **Durable generations only move forward**, and never to one at or below the record's ``floor``.
* **Stored bytes**: the tenant's ``stored_bytes`` counter is what the store holds for it, in unique
  bytes (shared chunks once): the chunk ledger adds what each save writes and subtracts what
  deletes free, each collection sets it exactly (:mod:`storage.chunks.ledger`), and ``reindex`` sets it
  from a listing (:meth:`SessionIndex.set_stored_bytes`). Records do not change it.
* **Generation numbers are never reused for one (tenant, session id)**, not even after a delete:
  saves take their number from :meth:`SessionIndex.reserve_generation` (or at least
  ``SessionRecord.next_generation``); deleting a record leaves a tombstone holding the highest
  generation the id recorded or handed out (kept ``floor_ttl_s``); a record created for the id
  again starts with that ``floor`` and refuses generations at or below it. So no generation of a
  new session can be mistaken for a copy of its deleted namesake's lingering in a node's spill
  cache or the store, and ``restore_spilled`` (reindex) does not adopt such leftovers either.

Engine LRU reads (:mod:`storage.index.occupancy`), routing (:mod:`storage.index.prefix_digests`) and
per-tenant counters (:mod:`storage.index.usage`) live in their own modules, mixed into
:class:`SessionIndex` so that callers hold one object.
``SessionIndex(in_process_redis())`` is the single-machine default: the same code on fakeredis.

On Redis Cluster (``split``) a transaction holds the tenant's keys only (one hash slot); the
engines' sets a transition changes are written beside it, as :mod:`storage.index.occupancy`
describes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import structlog

from storage.errors import GenerationUsed, InvalidId, NotStored, WriteConflict
from storage.ids import validate_generation, validate_id
from storage.index.keyspace import Keyspace, in_process_redis, member, redis_errors, text, transact
from storage.index.locks import SessionLock, check_owner
from storage.index.occupancy import EngineOccupancy, OccupancyWrites
from storage.index.prefix_digests import (
    DEFAULT_ROUTE_TTL_S,
    DEFAULT_ROUTES_PER_SESSION,
    PrefixRouting,
    route_ttl_ms,
    routes_kept,
    validate_digest,
)
from storage.index.records import SessionRecord, SessionState, checked
from storage.index.shared_prefixes import SharedPrefixes
from storage.index.topology import is_cluster
from storage.index.turnops import TurnOps
from storage.index.usage import TenantCounters

__all__ = ["SessionIndex", "SessionRecord", "SessionState", "in_process_redis"]
log = structlog.get_logger("slotkeeper.storage")
DEFAULT_FLOOR_TTL_S = 30 * 24 * 3600.0
Decide = Callable[[SessionRecord | None], SessionRecord]


class SessionIndex(EngineOccupancy, PrefixRouting, SharedPrefixes, TenantCounters, TurnOps):
    """Async session index; share one instance per process (it holds no per-call state).

    Besides records it offers the engines' LRUs (``idle_sessions``, ``engine_sessions``,
    ``slot_occupants``: :mod:`storage.index.occupancy`), implicit routing (``add_prefixes``,
    ``match_prefix``: :mod:`storage.index.prefix_digests`), shared prefixes (``queue_shared``,
    ``find_shared``: :mod:`storage.index.shared_prefixes`) and per-tenant counters (``incr_usage``, ``usage``,
    ``incr_window``, ``window_count``, ``acquire_inflight``, ``release_inflight``,
    ``inflight_count``: :mod:`storage.index.usage`) and the request path's one-round-trip steps
    (``start_turn``, ``apply``: :mod:`storage.index.turnops`).
    """

    def __init__(
        self,
        redis: Any,
        *,
        prefix: str = "slotkeeper",
        clock: Callable[[], float] = time.time,
        route_ttl_s: float = DEFAULT_ROUTE_TTL_S,
        routes_per_session: int = DEFAULT_ROUTES_PER_SESSION,
        floor_ttl_s: float | None = DEFAULT_FLOOR_TTL_S,
        split: bool | None = None,
    ) -> None:
        """``route_ttl_s``: how long implicit routes live after the session last recorded them.
        ``routes_per_session``: how many routing keys a session keeps, its newest (at least 2; see
        :mod:`storage.index.prefix_digests`).
        ``floor_ttl_s``: how long a deleted session's generation floor is kept (None: until the id
        is used again); it must outlast any stale copy (a node that was down during the delete).
        ``split``: write the engines' sets beside transitions, not in them (default: when
        ``redis`` is a Redis Cluster client; see the module doc)."""
        if floor_ttl_s is not None and floor_ttl_s <= 0:
            raise ValueError("floor_ttl_s must be > 0 or None")
        self._redis = redis
        self.keys = Keyspace(prefix)
        self._clock = clock
        self._floor_px = None if floor_ttl_s is None else max(1, round(floor_ttl_s * 1000))
        self.route_ttl_ms = route_ttl_ms(route_ttl_s)
        self.routes_per_session = routes_kept(routes_per_session)
        self._scripts: dict[str, Any] = {}  # registered Lua scripts by name (storage.index.turnops)
        self.split = is_cluster(redis) if split is None else split
        self._globals: tuple[float, list[Any]] | None = None  # split: the global keys as last read

    # -------------------------------------------------------------------------------------- reads
    async def find(self, tenant: str, session: str) -> SessionRecord | None:
        async with redis_errors():
            raw = await self._redis.hgetall(self.keys.session(tenant, session))
        return SessionRecord.from_hash(tenant, session, raw) if raw else None

    async def get(self, tenant: str, session: str) -> SessionRecord:
        return _found(await self.find(tenant, session), session)

    async def list_sessions(self, tenant: str) -> list[str]:
        """The tenant's session ids, least recently used first."""
        async with redis_errors():
            return [text(m) for m in await self._redis.zrange(self.keys.sessions(tenant), 0, -1)]

    async def unused_since(self, tenant: str, before: float, limit: int = 1000) -> list[str]:
        """The tenant's sessions last used before ``before`` (seconds), least recently used first."""
        async with redis_errors():
            key = self.keys.sessions(tenant)
            found = await self._redis.zrangebyscore(key, "-inf", before, start=0, num=limit)
        return [text(m) for m in found]

    async def count_sessions(self, tenant: str) -> int:
        """How many sessions the tenant has (O(1): the sessions quota needs no listing)."""
        async with redis_errors():
            return int(await self._redis.zcard(self.keys.sessions(tenant)))

    async def stored_bytes(self, tenant: str) -> int:
        """Bytes the store holds for the tenant (O(1)): unique bytes, counted by the chunk ledger
        (:mod:`storage.chunks.ledger`) as saves write and collections find them."""
        async with redis_errors():
            return int(await self._redis.get(self.keys.stored_bytes(tenant)) or 0)

    async def set_stored_bytes(self, tenant: str, total: int) -> None:
        """Set the tenant's stored-bytes counter (``reindex``: from a listing of the store)."""
        async with redis_errors():
            await self._redis.set(self.keys.stored_bytes(tenant), total)
        log.info("index.stored_bytes_set", tenant=tenant, bytes=total)

    async def generation_floor(self, tenant: str, session: str) -> int:
        """The generation a session with this id must save above: its record's floor, or what a
        deleted namesake left (0 when the id was never used)."""
        record = await self.find(tenant, session)
        if record is not None:
            return record.floor
        async with redis_errors():
            return int(await self._redis.get(self.keys.floor(tenant, session)) or 0)

    async def is_idle(self, tenant: str, session: str) -> bool:
        """Live and in its engine's idle LRU: no request is running on it (its lock, if held, is
        held for bookkeeping such as a write-behind save)."""
        record = await self.find(tenant, session)
        place = record.place if record is not None else None
        if place is None:
            return False
        async with redis_errors():
            score = await self._redis.zscore(self.keys.engine_idle(place[0]), member(tenant, session))
        return score is not None

    # ------------------------------------------------------------------------------- transitions
    async def _change(
        self,
        tenant: str,
        session: str,
        decide: Callable[[SessionRecord | None], SessionRecord | None],
        lock: SessionLock | None,
        idle: bool | None = None,
    ) -> SessionRecord | None:
        """Read the record, let ``decide`` (pure) produce the new one, write it and its indexes.

        ``idle`` True/False puts the session into / takes it out of its engine's idle LRU. A record
        created here inherits the floor a deleted namesake left; see the module doc.
        """
        key, routes = self.keys.session(tenant, session), self.keys.session_prefixes(tenant, session)
        floor_key = self.keys.floor(tenant, session)
        watch = [key, routes, floor_key] + ([self.keys.lock(tenant, session)] if lock is not None else [])
        if lock is not None and (lock.tenant, lock.session) != (tenant, session):
            raise InvalidId("lock", "belongs to another session")

        beside: list[OccupancyWrites] = []  # split: the engines' set writes of the last attempt

        async def body(pipe: Any) -> SessionRecord | None:
            beside.clear()
            await check_owner(pipe, self.keys, lock)
            raw = await pipe.hgetall(key)
            old = SessionRecord.from_hash(tenant, session, raw) if raw else None
            new = checked(old, decide(old))
            if new is not None and old is None:
                new = replace(new, floor=max(new.floor, int(await pipe.get(floor_key) or 0)))
            if new is not None and new.generation != (old.generation if old else 0):
                self._above_floor(new)
            # deleted: the prefix routes that still point at it go with it
            owned = await self._owned_routes(pipe, tenant, session) if new is None else []
            pipe.multi()
            if self.split:
                beside.append(OccupancyWrites())
            self._queue(pipe, old, new, tenant, session, idle, *beside)
            if new is None:
                pipe.delete(routes, *owned)
            if beside:
                await beside[0].run(self._redis, beside[0].adds)
            return new

        new = await transact(self._redis, watch, body)
        if beside:
            await beside[0].run(self._redis, beside[0].removes)
        if new is not None:
            # Spilled (an eviction, a drain) is worth a line on the console; a turn's own
            # transitions (new, live) are its access line's business there.
            (log.info if new.stored else log.debug)(
                "session.state",
                tenant=tenant,
                session=session,
                state=str(new.state),
                engine=new.engine,
                slot=new.slot,
                generation=new.generation,
                tokens=new.tokens,
            )
        return new

    def _queue(
        self,
        pipe: Any,
        old: SessionRecord | None,
        new: SessionRecord | None,
        tenant: str,
        session: str,
        idle: bool | None,
        beside: OccupancyWrites | None = None,
    ) -> None:
        """Queue (on a pipeline in MULTI, or on :class:`storage.index.turnops.Ops`) the writes that take
        the record and every index from ``old`` to ``new``; ``idle`` True/False also puts the
        session into / takes it out of its engine's idle LRU. ``beside``: where the engines' set
        writes go instead (Redis Cluster, see the module doc)."""
        m = member(tenant, session)
        engines: Any = pipe if beside is None else beside
        if old is not None and old.engine and (new is None or new.engine != old.engine):
            engines.zrem(self.keys.engine_idle(old.engine), m)
            engines.srem(self.keys.engine_live(old.engine), m)
        if new is None:
            pipe.delete(self.keys.session(tenant, session))
            pipe.zrem(self.keys.sessions(tenant), session)
            pipe.hdel(self.keys.tenant_live(tenant), session)
            floor = old.used_generations if old is not None else 0
            if floor:  # the tombstone: a later namesake saves above it
                pipe.set(self.keys.floor(tenant, session), floor, px=self._floor_px)
            return
        if old is None:  # the record carries the floor from now on
            pipe.delete(self.keys.floor(tenant, session))
        pipe.hset(self.keys.session(tenant, session), mapping=new.to_hash())
        pipe.zadd(self.keys.sessions(tenant), {session: new.last_used})
        if old is not None and old.engine and not new.engine:
            pipe.hdel(self.keys.tenant_live(tenant), session)
        if new.engine:
            if old is None or old.engine != new.engine:
                pipe.hset(self.keys.tenant_live(tenant), mapping={session: new.engine})
            engines.sadd(self.keys.engine_live(new.engine), m)
            if idle is not None:
                if idle:
                    engines.zadd(self.keys.engine_idle(new.engine), {m: new.last_used})
                else:
                    engines.zrem(self.keys.engine_idle(new.engine), m)

    async def create(
        self, tenant: str, session: str, *, model: str, tokens: int = 0, floor: int = 0
    ) -> SessionRecord:
        """A ``new`` session; :class:`WriteConflict` if the id is taken. Its ``floor`` is the highest of
        ``floor`` (e.g. the newest generation the store still lists for the id) and what a deleted
        namesake left; save it as ``record.next_generation``."""
        validate_generation(floor)

        def decide(old: SessionRecord | None) -> SessionRecord:
            if old is not None:
                raise WriteConflict(f"session {session} exists")
            return SessionRecord(
                tenant,
                session,
                SessionState.NEW,
                model=model,
                tokens=tokens,
                last_used=self._clock(),
                floor=floor,
            )

        return await self._required(tenant, session, decide, None)

    async def mark_live(
        self,
        tenant: str,
        session: str,
        *,
        engine: str,
        slot: int,
        tokens: int,
        model: str | None = None,
        lock: SessionLock | None = None,
    ) -> SessionRecord:
        """The session now occupies ``slot`` of ``engine`` and is busy (not in the idle LRU)."""
        decide = self.decide_live(tenant, session, engine=engine, slot=slot, tokens=tokens, model=model)
        return await self._required(tenant, session, decide, lock, idle=False)

    def decide_live(
        self, tenant: str, session: str, *, engine: str, slot: int, tokens: int, model: str | None = None
    ) -> Decide:
        """:meth:`mark_live`'s transition (for :meth:`apply` with ``idle=False``)."""
        validate_id(engine, "engine id")

        def decide(old: SessionRecord | None) -> SessionRecord:
            base = old or SessionRecord(tenant, session, SessionState.NEW, model=model or "")
            return replace(
                base,
                state=SessionState.LIVE,
                engine=engine,
                slot=slot,
                tokens=tokens,
                model=model or base.model,
                last_used=self._clock(),
                dirty=True,
            )

        return decide

    async def mark_busy(self, tenant: str, session: str, *, lock: SessionLock | None = None) -> SessionRecord:
        """A request started on the live session: it leaves its engine's idle LRU."""
        busy = self.decide_idle(session)  # the same touch of a live record, leaving the idle LRU
        return await self._required(
            tenant, session, lambda old: replace(busy(old), dirty=True), lock, idle=False
        )

    async def mark_idle(
        self,
        tenant: str,
        session: str,
        *,
        tokens: int | None = None,
        route: str | None = None,
        lock: SessionLock | None = None,
    ) -> SessionRecord:
        """The request finished: the live session joins its engine's idle LRU as most recent.
        ``route`` is its newest routing digest (see :meth:`add_prefixes`)."""
        return await self._required(
            tenant, session, self.decide_idle(session, tokens, route), lock, idle=True
        )

    def decide_idle(
        self,
        session: str,
        tokens: int | None = None,
        route: str | None = None,
        shared: str | None = None,
        prompt: str | None = None,
        head: str | None = None,
    ) -> Decide:
        """:meth:`mark_idle`'s transition (for :meth:`apply` with ``idle=True``); ``shared`` and
        ``prompt`` are the digests of its shared prefix and its last prompt
        (:mod:`storage.index.shared_prefixes`), ``head`` its last turn's (gateway.turn.branch), kept
        to be stored beside the route."""
        now = self._clock()

        def decide(old: SessionRecord | None) -> SessionRecord:
            if old is None or not old.live:
                raise WriteConflict(f"session {session} is not live")
            return replace(
                old,
                tokens=old.tokens if tokens is None else tokens,
                last_used=now,
                route=old.route if route is None else validate_digest(route),
                shared=old.shared if shared is None else validate_digest(shared),
                prompt=old.prompt if prompt is None else validate_digest(prompt),
                head=old.head if head is None else validate_digest(head),
            )

        return decide

    async def mark_spilled(
        self,
        tenant: str,
        session: str,
        *,
        generation: int,
        blob_key: str,
        nbytes: int,
        tokens: int | None = None,
        lock: SessionLock | None = None,
    ) -> SessionRecord:
        """Evicted from its slot; the state lives on as durable ``generation`` (recorded as
        :meth:`set_durable` records it)."""
        durable = self.decide_durable(session, generation=generation, blob_key=blob_key, nbytes=nbytes)

        def decide(old: SessionRecord | None) -> SessionRecord:
            new = durable(old)
            return replace(
                new,
                state=SessionState.SPILLED,
                engine=None,
                slot=None,
                tokens=new.tokens if tokens is None else tokens,
                last_used=self._clock(),
            )

        return await self._required(tenant, session, decide, lock)

    async def set_durable(
        self,
        tenant: str,
        session: str,
        *,
        generation: int,
        blob_key: str,
        nbytes: int,
        lock: SessionLock | None = None,
    ) -> SessionRecord:
        """A write-behind save of a live session completed: record the newer durable generation."""
        return await self._required(
            tenant,
            session,
            self.decide_durable(session, generation=generation, blob_key=blob_key, nbytes=nbytes),
            lock,
        )

    def decide_durable(
        self,
        session: str,
        *,
        generation: int,
        blob_key: str,
        nbytes: int,
        since: float | None = None,
        slot: tuple[str, int] | None = None,
    ) -> Decide:
        """:meth:`set_durable`'s transition. ``since``: the record's ``last_used`` when the saved
        state was taken; a record used after it (a later turn ran meanwhile) stays ``dirty``.
        ``slot``: the (engine, slot) the state was saved from; a record no longer live there (its
        engine died meanwhile and the node dropped it) refuses it with :class:`WriteConflict` — that slot
        may hold another session's state by now."""
        validate_generation(generation)

        def decide(old: SessionRecord | None) -> SessionRecord:
            old = _found(old, session)
            if slot is not None and not old.live_in(*slot):
                raise WriteConflict(f"session {session} left the slot it was saved from")
            self._forward(old, generation)
            dirty = since is not None and old.last_used != since
            return replace(old, generation=generation, blob_key=blob_key, bytes=nbytes, dirty=dirty)

        return decide

    async def reserve_generation(self, tenant: str, session: str, *, lock: SessionLock | None = None) -> int:
        """Hand out the generation for the next save (``record.next_generation``), and remember
        it: a save whose answer is lost still counts, so no later save nor a namesake after a
        delete gets the same number. :class:`NotStored` without a record."""

        return (await self._required(tenant, session, self.decide_reserve(session), lock)).reserved

    def decide_reserve(self, session: str) -> Decide:
        """:meth:`reserve_generation`'s transition (the number is the new record's ``reserved``)."""

        def decide(old: SessionRecord | None) -> SessionRecord:
            old = _found(old, session)
            return replace(old, reserved=old.next_generation)

        return decide

    async def transition(
        self,
        tenant: str,
        session: str,
        decide: Decide,
        *,
        lock: SessionLock | None = None,
        idle: bool | None = None,
    ) -> SessionRecord:
        """Apply a ``decide_*`` transition in the WATCH/MULTI transaction (reading the record
        first): what :meth:`apply` falls back to."""
        return await self._required(tenant, session, decide, lock, idle)

    @staticmethod
    def _forward(old: SessionRecord, generation: int) -> None:
        if generation < old.generation:
            raise WriteConflict(f"generation {generation} is older than durable generation {old.generation}")

    @staticmethod
    def _above_floor(new: SessionRecord) -> None:
        if new.generation and new.generation <= new.floor:
            raise GenerationUsed(
                f"generation {new.generation} of session {new.session} belonged to a deleted session "
                f"with this id; save as generation {new.next_generation} or later"
            )

    async def delete(self, tenant: str, session: str, *, lock: SessionLock | None = None) -> None:
        """Forget the session, its prefix routes and its LRU membership, take its bytes off the
        tenant's stored bytes and leave its generation floor (idempotent). Its stored generations
        are the caller's to delete (:func:`storage.blobs.blobstore.delete_generations`)."""
        await self._change(tenant, session, lambda old: None, lock)
        log.info("session.deleted", tenant=tenant, session=session)

    async def drop_engine(self, engine: str) -> list[tuple[str, str]]:
        """The engine died: its live sessions fall back to their durable generation (or ``new``).
        Only the members dropped, or whose record no longer places them there, leave the engine's
        sets: a session recorded live on it meanwhile (its restarted process) stays."""
        dropped = []
        unplaced = self.decide_unplaced(engine)
        for tenant, session in await self.engine_sessions(engine):
            new = await self._change(tenant, session, lambda old: old if old is None else unplaced(old), None)
            if new is not None and new.engine == engine:
                continue
            if new is None:  # a member without a record: nothing keeps it in the sets
                async with redis_errors():
                    m = member(tenant, session)
                    await self._redis.srem(self.keys.engine_live(engine), m)
                    await self._redis.zrem(self.keys.engine_idle(engine), m)
            dropped.append((tenant, session))
        return dropped

    @staticmethod
    def decide_unplaced(engine: str, slot: int | None = None) -> Decide:
        """The session no longer holds its slot on ``engine`` (``slot``: that one only): it falls
        back to its durable generation (or ``new``), as if spilled there. Its slot's newer state,
        if any, is gone (the engine died, or the slot holds another session's state). A record
        placed elsewhere is left as it is."""

        def decide(old: SessionRecord | None) -> SessionRecord:
            if old is None:
                raise NotStored("the session has no record")
            if not old.live_in(engine, slot):
                return old
            state = SessionState.SPILLED if old.generation else SessionState.NEW
            return replace(old, state=state, engine=None, slot=None, dirty=False)

        return decide

    async def adopt_live(
        self, tenant: str, session: str, *, engine: str, slot: int, tokens: int, model: str
    ) -> bool:
        """Healing a lost index: the session an engine's slot says it holds (its label) recorded live
        and idle there, unless the index knows it live already (newer than any label) or stored with
        more tokens than the slot holds (a label older than the store's copy). True when adopted."""
        live = self.decide_live(tenant, session, engine=engine, slot=slot, tokens=tokens, model=model)

        def decide(old: SessionRecord | None) -> SessionRecord:
            if old is not None and (old.live or old.tokens > tokens):
                return old
            return live(old)  # dirty: the slot may hold more than any stored generation

        before = await self.find(tenant, session)
        after = await self._change(tenant, session, decide, None, idle=True)
        return after is not None and after.live and after != before

    async def restore_spilled(self, record: SessionRecord) -> bool:
        """Reindex: adopt a durable generation from storage unless the index knows a newer state,
        or the generation is at or below the id's floor (a leftover of a deleted namesake)."""

        def decide(old: SessionRecord | None) -> SessionRecord | None:
            if old is None:
                return replace(record, state=SessionState.SPILLED, engine=None, slot=None)
            if old.generation >= record.generation:
                return old
            if old.live:  # the slot is newer than any file; keep it live
                return replace(
                    old, generation=record.generation, blob_key=record.blob_key, bytes=record.bytes
                )
            return replace(
                record,
                state=SessionState.SPILLED,
                engine=None,
                slot=None,
                floor=old.floor,
                reserved=old.reserved,
            )

        before = await self.find(record.tenant, record.session)
        try:
            after = await self._change(record.tenant, record.session, decide, None)
        except GenerationUsed:
            log.warning(
                "index.leftover_generation",
                tenant=record.tenant,
                session=record.session,
                generation=record.generation,
            )
            return False
        return after != before

    async def _required(
        self,
        tenant: str,
        session: str,
        decide: Callable[[SessionRecord | None], SessionRecord],
        lock: SessionLock | None,
        idle: bool | None = None,
    ) -> SessionRecord:
        record = await self._change(tenant, session, decide, lock, idle)
        assert record is not None
        return record


def _found(record: SessionRecord | None, session: str) -> SessionRecord:
    """The record, or :class:`NotStored` when there is none."""
    if record is None:
        raise NotStored(f"session {session} not found")
    return record

"""The session index on Redis: session records, message-prefix routing, engine LRUs, usage.

Keys (see :class:`~storage.keyspace.Keyspace`) are namespaced by a prefix and the tenant; every
change that touches several keys — a record plus its tenant listing plus an engine's idle LRU and
live set — is one WATCH/MULTI transaction, so a reader never sees half a transition. Writes may
present a :class:`~storage.locks.SessionLock`; the transaction then also proves the lock is still
held (fencing), raising :class:`LockLost` otherwise. Durable generations only move forward.

``SessionIndex(in_process_redis())`` is the single-machine default: the same code on fakeredis.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from typing import Any

import structlog

from storage.errors import Conflict, InvalidId, NotFound
from storage.ids import validate_generation, validate_id
from storage.keyspace import (
    Keyspace,
    in_process_redis,
    member,
    parse_member,
    redis_errors,
    text,
    text_map,
    transact,
)
from storage.locks import SessionLock, check_owner

__all__ = ["SessionIndex", "SessionRecord", "SessionState", "in_process_redis"]
log = structlog.get_logger("slotkeeper.storage")
_DIGEST = re.compile(r"[0-9a-f]{16,128}")
_COUNTER = re.compile(r"[a-z][a-z0-9_]{0,63}")


class SessionState(StrEnum):
    NEW = "new"  # known, nothing saved yet
    LIVE = "live"  # in an engine slot (busy, or idle in the engine's LRU)
    SPILLED = "spilled"  # only in the spill cache / blob store, at ``generation``


@dataclass(frozen=True)
class SessionRecord:
    tenant: str
    session: str
    state: SessionState
    model: str = ""
    tokens: int = 0
    engine: str | None = None
    slot: int | None = None
    generation: int = 0  # newest durable generation; 0 = none
    blob_key: str = ""
    bytes: int = 0
    last_used: float = 0.0
    route: str = ""  # newest routing digest: stored with the slot file, so reindex restores it
    dirty: bool = False  # the slot changed since durable `generation` was saved

    def to_hash(self) -> dict[str, str]:
        fields = asdict(self)
        del fields["tenant"], fields["session"]
        fields["engine"] = self.engine or ""
        fields["slot"] = "" if self.slot is None else str(self.slot)
        return {k: str(v) for k, v in fields.items()}

    @classmethod
    def from_hash(cls, tenant: str, session: str, raw: Mapping[Any, Any]) -> SessionRecord:
        h = text_map(dict(raw))
        return cls(
            tenant=tenant, session=session, state=SessionState(h["state"]), model=h.get("model", ""),
            tokens=int(h.get("tokens", 0)), engine=h.get("engine") or None,
            slot=int(h["slot"]) if h.get("slot") else None, generation=int(h.get("generation", 0)),
            blob_key=h.get("blob_key", ""), bytes=int(h.get("bytes", 0)),
            last_used=float(h.get("last_used", 0)), route=h.get("route", ""), dirty=h.get("dirty") == "True",
        )  # fmt: skip


class SessionIndex:
    """Async session index; share one instance per process (it holds no per-call state)."""

    def __init__(
        self, redis: Any, *, prefix: str = "slotkeeper", clock: Callable[[], float] = time.time
    ) -> None:
        self._redis = redis
        self.keys = Keyspace(prefix)
        self._clock = clock

    # -------------------------------------------------------------------------------------- reads
    async def find(self, tenant: str, session: str) -> SessionRecord | None:
        async with redis_errors():
            raw = await self._redis.hgetall(self.keys.session(tenant, session))
        return SessionRecord.from_hash(tenant, session, raw) if raw else None

    async def find_many(self, pairs: Sequence[tuple[str, str]]) -> list[SessionRecord | None]:
        """`find` for many ``(tenant, session)`` in one round trip (placement snapshots)."""
        if not pairs:
            return []
        async with redis_errors(), self._redis.pipeline(transaction=False) as pipe:
            for tenant, session in pairs:
                pipe.hgetall(self.keys.session(tenant, session))
            raws = await pipe.execute()
        return [
            SessionRecord.from_hash(t, s, raw) if raw else None
            for (t, s), raw in zip(pairs, raws, strict=True)
        ]

    async def get(self, tenant: str, session: str) -> SessionRecord:
        record = await self.find(tenant, session)
        if record is None:
            raise NotFound(f"session {session} not found")
        return record

    async def list_sessions(self, tenant: str) -> list[str]:
        """The tenant's session ids, least recently used first."""
        async with redis_errors():
            return [text(m) for m in await self._redis.zrange(self.keys.sessions(tenant), 0, -1)]

    async def is_idle(self, tenant: str, session: str) -> bool:
        """Live and in its engine's idle LRU: no request is running on it (its lock, if held, is
        held for bookkeeping such as a write-behind save)."""
        record = await self.find(tenant, session)
        if record is None or record.state is not SessionState.LIVE or not record.engine:
            return False
        async with redis_errors():
            score = await self._redis.zscore(self.keys.engine_idle(record.engine), member(tenant, session))
        return score is not None

    async def idle_sessions(self, engine: str, limit: int | None = None) -> list[tuple[str, str]]:
        """``(tenant, session)`` idle on ``engine``, least recently used first (eviction order)."""
        async with redis_errors():
            raw = await self._redis.zrange(
                self.keys.engine_idle(engine), 0, -1 if limit is None else limit - 1
            )
        return [parse_member(text(m)) for m in raw]

    async def engine_sessions(self, engine: str) -> list[tuple[str, str]]:
        """``(tenant, session)`` live on ``engine``, busy or idle."""
        async with redis_errors():
            raw = await self._redis.smembers(self.keys.engine_live(engine))
        return sorted(parse_member(text(m)) for m in raw)

    async def engines_sessions(self, engines: Sequence[str]) -> dict[str, list[tuple[str, str]]]:
        """`engine_sessions` for many engines in one round trip."""
        live, _ = await self.engines_occupancy(engines)
        return live

    async def engines_occupancy(
        self, engines: Sequence[str]
    ) -> tuple[dict[str, list[tuple[str, str]]], set[tuple[str, str]]]:
        """For many engines in one round trip: the sessions live on each, and which of all those
        are idle (in their engine's LRU: no request runs on them)."""
        if not engines:
            return {}, set()
        async with redis_errors(), self._redis.pipeline(transaction=False) as pipe:
            for engine in engines:
                pipe.smembers(self.keys.engine_live(engine))
                pipe.zrange(self.keys.engine_idle(engine), 0, -1)
            raws = await pipe.execute()
        live = {e: sorted(parse_member(text(m)) for m in raws[2 * i]) for i, e in enumerate(engines)}
        idle = {parse_member(text(m)) for i in range(len(engines)) for m in raws[2 * i + 1]}
        return live, idle

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

        ``idle`` True/False puts the session into / takes it out of its engine's idle LRU.
        """
        key, routes = self.keys.session(tenant, session), self.keys.session_prefixes(tenant, session)
        watch = [key, routes] + ([self.keys.lock(tenant, session)] if lock is not None else [])
        if lock is not None and (lock.tenant, lock.session) != (tenant, session):
            raise InvalidId("lock", "belongs to another session")

        async def body(pipe: Any) -> SessionRecord | None:
            await check_owner(pipe, self.keys, lock)
            raw = await pipe.hgetall(key)
            old = SessionRecord.from_hash(tenant, session, raw) if raw else None
            new = decide(old)
            owned: list[str] = []
            if new is None:  # deleted: the prefix routes that still point at it go with it
                route_keys = [self.keys.prefix_hash(tenant, text(d)) for d in await pipe.smembers(routes)]
                if route_keys:
                    await pipe.watch(*route_keys)
                    targets = await pipe.mget(route_keys)
                    owned = [
                        k
                        for k, t in zip(route_keys, targets, strict=True)
                        if t is not None and text(t) == session
                    ]
            pipe.multi()
            self._write(pipe, old, new, tenant, session)
            if new is None:
                pipe.delete(routes, *owned)
            elif new.engine and idle is not None:
                m = member(tenant, session)
                if idle:
                    pipe.zadd(self.keys.engine_idle(new.engine), {m: new.last_used})
                else:
                    pipe.zrem(self.keys.engine_idle(new.engine), m)
            return new

        new = await transact(self._redis, watch, body)
        if new is not None:
            log.info("session.state", tenant=tenant, session=session, state=str(new.state), engine=new.engine,
                     slot=new.slot, generation=new.generation, tokens=new.tokens)  # fmt: skip
        return new

    def _write(
        self, pipe: Any, old: SessionRecord | None, new: SessionRecord | None, tenant: str, session: str
    ) -> None:
        """Queue the writes that take the record and every index from ``old`` to ``new``."""
        m = member(tenant, session)
        if old is not None and old.engine and (new is None or new.engine != old.engine):
            pipe.zrem(self.keys.engine_idle(old.engine), m)
            pipe.srem(self.keys.engine_live(old.engine), m)
        if new is None:
            pipe.delete(self.keys.session(tenant, session))
            pipe.zrem(self.keys.sessions(tenant), session)
            return
        pipe.hset(self.keys.session(tenant, session), mapping=new.to_hash())
        pipe.zadd(self.keys.sessions(tenant), {session: new.last_used})
        if new.engine:
            pipe.sadd(self.keys.engine_live(new.engine), m)

    async def create(self, tenant: str, session: str, *, model: str, tokens: int = 0) -> SessionRecord:
        """A ``new`` session; :class:`Conflict` if the id is taken."""

        def decide(old: SessionRecord | None) -> SessionRecord:
            if old is not None:
                raise Conflict(f"session {session} exists")
            return SessionRecord(
                tenant, session, SessionState.NEW, model=model, tokens=tokens, last_used=self._clock()
            )

        return await self._required(tenant, session, decide, None)

    async def mark_live(
        self, tenant: str, session: str, *, engine: str, slot: int, tokens: int, model: str | None = None,
        lock: SessionLock | None = None,
    ) -> SessionRecord:  # fmt: skip
        """The session now occupies ``slot`` of ``engine`` and is busy (not in the idle LRU)."""
        validate_id(engine, "engine id")

        def decide(old: SessionRecord | None) -> SessionRecord:
            base = old or SessionRecord(tenant, session, SessionState.NEW, model=model or "")
            return replace(base, state=SessionState.LIVE, engine=engine, slot=slot, tokens=tokens,
                           model=model or base.model, last_used=self._clock(), dirty=True)  # fmt: skip

        return await self._required(tenant, session, decide, lock, idle=False)

    async def mark_busy(self, tenant: str, session: str, *, lock: SessionLock | None = None) -> SessionRecord:
        """A request started on the live session: it leaves its engine's idle LRU."""
        busy = self._touch_live(session)
        return await self._required(
            tenant, session, lambda old: replace(busy(old), dirty=True), lock, idle=False
        )

    def _touch_live(
        self, session: str, tokens: int | None = None, route: str | None = None
    ) -> Callable[[SessionRecord | None], SessionRecord]:
        now = self._clock()

        def decide(old: SessionRecord | None) -> SessionRecord:
            if old is None or old.state is not SessionState.LIVE or not old.engine:
                raise Conflict(f"session {session} is not live")
            return replace(old, tokens=old.tokens if tokens is None else tokens, last_used=now,
                           route=old.route if route is None else self._digest(route))  # fmt: skip

        return decide

    async def mark_idle(
        self, tenant: str, session: str, *, tokens: int | None = None, route: str | None = None,
        lock: SessionLock | None = None,
    ) -> SessionRecord:  # fmt: skip
        """The request finished: the live session joins its engine's idle LRU as most recent.
        ``route`` is its newest routing digest (see :meth:`add_prefixes`)."""
        return await self._required(
            tenant, session, self._touch_live(session, tokens, route), lock, idle=True
        )

    async def mark_spilled(
        self, tenant: str, session: str, *, generation: int, blob_key: str, nbytes: int,
        tokens: int | None = None, lock: SessionLock | None = None,
    ) -> SessionRecord:  # fmt: skip
        """Evicted from its slot; the state lives on as durable ``generation``."""
        validate_generation(generation)

        def decide(old: SessionRecord | None) -> SessionRecord:
            if old is None:
                raise NotFound(f"session {session} not found")
            self._forward(old, generation)
            return replace(old, state=SessionState.SPILLED, engine=None, slot=None, generation=generation,
                           blob_key=blob_key, bytes=nbytes, tokens=old.tokens if tokens is None else tokens,
                           last_used=self._clock(), dirty=False)  # fmt: skip

        return await self._required(tenant, session, decide, lock)

    async def set_durable(
        self, tenant: str, session: str, *, generation: int, blob_key: str, nbytes: int,
        lock: SessionLock | None = None,
    ) -> SessionRecord:  # fmt: skip
        """A write-behind save of a live session completed: record the newer durable generation."""
        validate_generation(generation)

        def decide(old: SessionRecord | None) -> SessionRecord:
            if old is None:
                raise NotFound(f"session {session} not found")
            self._forward(old, generation)
            return replace(old, generation=generation, blob_key=blob_key, bytes=nbytes, dirty=False)

        return await self._required(tenant, session, decide, lock)

    @staticmethod
    def _forward(old: SessionRecord, generation: int) -> None:
        if generation < old.generation:
            raise Conflict(f"generation {generation} is older than durable generation {old.generation}")

    async def delete(self, tenant: str, session: str, *, lock: SessionLock | None = None) -> None:
        """Forget the session, its prefix routes and its LRU membership (idempotent)."""
        await self._change(tenant, session, lambda old: None, lock)
        log.info("session.deleted", tenant=tenant, session=session)

    async def drop_engine(self, engine: str) -> list[tuple[str, str]]:
        """The engine died: its live sessions fall back to their durable generation (or ``new``)."""
        dropped = []
        for tenant, session in await self.engine_sessions(engine):

            def decide(old: SessionRecord | None) -> SessionRecord | None:
                if old is None or old.engine != engine:
                    return old
                state = SessionState.SPILLED if old.generation else SessionState.NEW
                return replace(old, state=state, engine=None, slot=None)

            await self._change(tenant, session, decide, None)
            dropped.append((tenant, session))
        async with redis_errors():
            await self._redis.delete(self.keys.engine_idle(engine), self.keys.engine_live(engine))
        return dropped

    async def restore_spilled(self, record: SessionRecord) -> bool:
        """Reindex: adopt a durable generation from storage unless the index knows a newer state."""

        def decide(old: SessionRecord | None) -> SessionRecord | None:
            if old is None:
                return replace(record, state=SessionState.SPILLED, engine=None, slot=None)
            if old.generation >= record.generation:
                return old
            if old.state is SessionState.LIVE:  # the slot is newer than any file; keep it live
                return replace(
                    old, generation=record.generation, blob_key=record.blob_key, bytes=record.bytes
                )
            return replace(record, state=SessionState.SPILLED, engine=None, slot=None)

        before = await self.find(record.tenant, record.session)
        after = await self._change(record.tenant, record.session, decide, None)
        return after != before

    async def _required(
        self, tenant: str, session: str, decide: Callable[[SessionRecord | None], SessionRecord],
        lock: SessionLock | None, idle: bool | None = None,
    ) -> SessionRecord:  # fmt: skip
        record = await self._change(tenant, session, decide, lock, idle)
        assert record is not None
        return record

    # ---------------------------------------------------------------------------- prefix routing
    async def add_prefixes(self, tenant: str, session: str, digests: Iterable[str]) -> None:
        """Route these message-prefix hashes (lowercase hex) to ``session``."""
        digests = [self._digest(d) for d in digests]
        async with redis_errors(), self._redis.pipeline(transaction=True) as pipe:
            for digest in digests:
                pipe.set(self.keys.prefix_hash(tenant, digest), validate_id(session, "session id"))
            if digests:
                pipe.sadd(self.keys.session_prefixes(tenant, session), *digests)
            await pipe.execute()

    async def match_prefix(self, tenant: str, digests: Sequence[str]) -> tuple[str, str] | None:
        """The first of ``digests`` (pass the longest prefix first) routed to a live record."""
        if not digests:
            return None
        keys = [self.keys.prefix_hash(tenant, self._digest(d)) for d in digests]
        async with redis_errors():
            sessions = await self._redis.mget(keys)
        for digest, session in zip(digests, sessions, strict=True):
            if session is not None and await self.find(tenant, text(session)) is not None:
                return digest, text(session)
        return None

    @staticmethod
    def _digest(digest: str) -> str:
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            raise InvalidId("prefix digest", "must be 16-128 lowercase hex characters")
        return digest

    # ------------------------------------------------------------------------------------- usage
    async def incr_usage(self, tenant: str, counters: Mapping[str, int]) -> dict[str, int]:
        """Add to the tenant's counters atomically; returns their new values."""
        names = list(counters)
        for name in names:
            if not _COUNTER.fullmatch(name):
                raise InvalidId("usage counter", f"{name!r} must match {_COUNTER.pattern}")
        async with redis_errors(), self._redis.pipeline(transaction=True) as pipe:
            for name in names:
                pipe.hincrby(self.keys.usage(tenant), name, int(counters[name]))
            values = await pipe.execute()
        return dict(zip(names, (int(v) for v in values), strict=True))

    async def usage(self, tenant: str) -> dict[str, int]:
        async with redis_errors():
            raw = await self._redis.hgetall(self.keys.usage(tenant))
        return {k: int(v) for k, v in text_map(raw).items()}

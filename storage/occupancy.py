"""Reads of the engines' session sets: which sessions are live on an engine, and its idle LRU.

Each engine has a SET of the ``tenant:session`` members live in its slots (busy or idle) and a
ZSET of those idle, scored by last use: the eviction order. :class:`storage.index.SessionIndex`
keeps both in step with the records inside its transitions; this mixin only reads them, in one
round trip for placement snapshots.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from storage.keyspace import Keyspace, parse_member, redis_errors, text
from storage.records import SessionRecord


class EngineOccupancy:
    """The engine-LRU reads of :class:`storage.index.SessionIndex` (a mixin: it uses the index's
    client and keyspace)."""

    _redis: Any
    keys: Keyspace

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

    async def occupants(
        self, pairs: Sequence[tuple[str, str]]
    ) -> list[tuple[SessionRecord | None, str | None]]:
        """For many ``(tenant, session)`` in one round trip: the record and the lock's owner token
        (None: unlocked)."""
        if not pairs:
            return []
        async with redis_errors(), self._redis.pipeline(transaction=False) as pipe:
            for tenant, session in pairs:
                pipe.hgetall(self.keys.session(tenant, session))
                pipe.get(self.keys.lock(tenant, session))
            raws = await pipe.execute()
        return [
            (SessionRecord.from_hash(t, s, raws[2 * i]) if raws[2 * i] else None,
             None if raws[2 * i + 1] is None else text(raws[2 * i + 1]))
            for i, (t, s) in enumerate(pairs)
        ]  # fmt: skip

    async def tenant_live_engines(self, tenant: str) -> set[str]:
        """The engines holding the tenant's live sessions (O(its live sessions))."""
        async with redis_errors():
            return {text(e) for e in await self._redis.hvals(self.keys.tenant_live(tenant))}

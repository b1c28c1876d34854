"""Reads of the engines' session sets: which sessions are live on an engine, and its idle LRU.

Each engine has a SET of the ``tenant:session`` members live in its slots (busy or idle) and a
ZSET of those idle, scored by last use: the eviction order. :class:`storage.index.session_index.SessionIndex`
keeps both in step with the records inside its transitions; this mixin only reads them, in one
round trip for pool views.

On Redis Cluster an engine's sets live in the engine's slot (``{e:ENGINE}``), its sessions'
records in their tenants' slots, so no script reads both: the sets are written beside a transition
rather than inside it (members added before the record says so, removed after), which makes a
member a hint that the record confirms, never the truth. A pool view there is two round trips: the
sets (a script per engine), then the members' records and locks (a script per tenant), each round
one pipeline whose scripts run on their shards at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from redis.exceptions import NoScriptError

from storage.index.keyspace import REDIS_FAILURES, Keyspace, parse_member, redis_errors, text
from storage.index.records import SessionState
from storage.index.scripts import IndexScripts

log = structlog.get_logger("slotkeeper.storage")

# KEYS: each engine's live SET and idle ZSET, in pairs. ARGV[1], ARGV[2]: what goes before and after
# a tenant id in its keys (`Keyspace.tenant_parts`), so that records and locks are found as the
# Keyspace names them (`{prefix}:{t:TENANT}:s:{session}`, `...:lock:{session}`); one primary only.
# One line per live session: engine index, tenant, session, state, engine, slot, last_used, lock
# owner, 1 if idle; tab-separated.
_SLOTS = """
local out = {}
for i = 1, #KEYS, 2 do
  local idle = {}
  for _, m in ipairs(redis.call('ZRANGE', KEYS[i + 1], 0, -1)) do idle[m] = true end
  for _, m in ipairs(redis.call('SMEMBERS', KEYS[i])) do
    local sep = string.find(m, ':', 1, true)
    local tenant, session = string.sub(m, 1, sep - 1), string.sub(m, sep + 1)
    local base = ARGV[1] .. tenant .. ARGV[2]
    local rec = redis.call('HMGET', base .. ':s:' .. session, 'state', 'engine', 'slot', 'last_used')
    local owner = redis.call('GET', base .. ':lock:' .. session)
    out[#out + 1] = table.concat({(i + 1) / 2, tenant, session, rec[1] or '', rec[2] or '', rec[3] or '',
      rec[4] or '', owner or '', idle[m] and '1' or '0'}, '\t')
  end
end
return out
"""
# Redis Cluster (module doc), round 1 — KEYS: an engine's live SET and idle ZSET. Its members, and
# those of them idle.
_ENGINE_SETS = "return {redis.call('SMEMBERS', KEYS[1]), redis.call('ZRANGE', KEYS[2], 0, -1)}"
# Round 2 — KEYS: one tenant's records and locks, in pairs (one slot). One line per pair: state,
# engine, slot, last_used, lock owner ('' for what is missing); tab-separated.
_OCCUPANTS = """
local out = {}
for i = 1, #KEYS, 2 do
  local rec = redis.call('HMGET', KEYS[i], 'state', 'engine', 'slot', 'last_used')
  out[#out + 1] = table.concat({rec[1] or '', rec[2] or '', rec[3] or '', rec[4] or '',
    redis.call('GET', KEYS[i + 1]) or ''}, '\t')
end
return out
"""


class OccupancyWrites:
    """An engine's set writes of one transition, kept apart on Redis Cluster (see the module doc):
    the subset of a pipeline's methods that ``SessionIndex._queue`` calls for engine keys. Members
    join before the record says so (``adds``) and leave after it does (``removes``), so that a
    member missing while its record names the engine never happens; a member left over is a hint
    that readers check against the record."""

    def __init__(self) -> None:
        self.adds: list[tuple[str, str, tuple[Any, ...]]] = []
        self.removes: list[tuple[str, str, tuple[Any, ...]]] = []

    def sadd(self, key: str, *members: str) -> None:
        self.adds.append(("sadd", key, members))

    def zadd(self, key: str, mapping: dict[str, float]) -> None:
        self.adds.append(("zadd", key, (mapping,)))

    def srem(self, key: str, *members: str) -> None:
        self.removes.append(("srem", key, members))

    def zrem(self, key: str, *members: str) -> None:
        self.removes.append(("zrem", key, members))

    async def run(self, redis: Any, writes: list[tuple[str, str, tuple[Any, ...]]]) -> None:
        """Carry ``writes`` out, each engine's in one round trip (its keys share a slot). Best
        effort: an engine's shard away costs its hints (readers confirm by the record), never the
        transition, nor other tenants' turns."""
        by_key: dict[str, list[tuple[str, tuple[Any, ...]]]] = {}
        for name, key, args in writes:
            by_key.setdefault(key.rpartition("}")[0], []).append((name, (key, *args)))

        async def one(calls: list[tuple[str, tuple[Any, ...]]]) -> None:
            async with redis.pipeline(transaction=False) as pipe:
                for name, args in calls:
                    getattr(pipe, name)(*args)
                await pipe.execute()

        for outcome in await asyncio.gather(*(one(c) for c in by_key.values()), return_exceptions=True):
            if isinstance(outcome, REDIS_FAILURES):
                log.warning("index.occupancy_write_failed", error=str(outcome))
            elif isinstance(outcome, BaseException):
                raise outcome


@dataclass(frozen=True)
class Occupant:
    """A session as a pool view sees it: a few fields of its record and its lock's owner."""

    live: bool
    engine: str | None
    slot: int | None
    last_used: float
    owner: str | None


class EngineOccupancy(IndexScripts):
    """The engine-LRU reads of :class:`storage.index.session_index.SessionIndex` (a mixin: it uses the index's
    client and keyspace)."""

    keys: Keyspace
    split: bool  # Redis Cluster: engines' sets and records are in different slots (module doc)

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

    async def slot_occupants(
        self, engines: Sequence[str], skipped: set[str] | None = None
    ) -> list[tuple[str, tuple[str, str], Occupant | None, bool]]:
        """Every session live on these engines — (engine, (tenant, session), its occupant fields
        or None without a record, idle?) — in ONE command (a script), whatever their number:
        a pool view's whole read. On Redis Cluster two round trips, and an engine that could not
        be read is left out and added to ``skipped`` (see ``_split_occupants``)."""
        if not engines:
            return []
        if self.split:
            rows = await self._split_occupants(engines, set() if skipped is None else skipped)
        else:
            keys = [k for e in engines for k in (self.keys.engine_live(e), self.keys.engine_idle(e))]
            script = self._script("slots", _SLOTS)
            async with redis_errors():
                lines = await script(keys=keys, args=list(self.keys.tenant_parts()))
            rows = [text(line).split("\t") for line in lines]
        found = []
        for i, tenant, session, state, engine, slot, last_used, owner, idle in rows:
            occupant = (
                Occupant(
                    state == SessionState.LIVE,
                    engine or None,
                    int(slot) if slot else None,
                    float(last_used or 0),
                    owner or None,
                )
                if state
                else None
            )
            found.append((engines[int(i) - 1], (tenant, session), occupant, idle == "1"))
        return found

    async def _split_occupants(self, engines: Sequence[str], skipped: set[str]) -> list[list[str]]:
        """What the ``_SLOTS`` script returns, read in two round trips (Redis Cluster: see the module
        doc): a script per engine, then one per tenant, each round one pipeline. An engine whose
        sets, or one of whose members' records, cannot be read (its shard away) is left out and
        named in ``skipped``: a view must not take its unknown slots for free ones."""
        scripts = {"engine_sets": _ENGINE_SETS, "occupants": _OCCUPANTS}
        shas = {name: str(self._script(name, source).sha) for name, source in scripts.items()}

        async def pipelined(calls: list[tuple[str, list[str]]]) -> list[Any]:
            """Each call's reply: its script (by name) over its keys, by SHA; where a shard lost
            the scripts (restarted, promoted) the whole pipeline is sent again with their bodies,
            which that shard keeps for the next view."""
            try:
                return await self._evaluated("evalsha", calls, shas)
            except NoScriptError:
                return await self._evaluated("eval", calls, scripts)

        async def gathered(groups: list[tuple[str, list[str]]]) -> list[Any]:
            """Each call's reply (or the error that kept it from being read): one pipeline for
            all (a round trip per shard, at once), or, when a shard fails it, one per call."""
            try:
                return await pipelined(groups)
            except REDIS_FAILURES:
                outcomes = await asyncio.gather(*(pipelined([g]) for g in groups), return_exceptions=True)
                return [o[0] if isinstance(o, list) else o for o in outcomes]

        read = await gathered(
            [("engine_sets", [self.keys.engine_live(e), self.keys.engine_idle(e)]) for e in engines]
        )
        members: dict[str, list[tuple[int, str, bool]]] = {}  # tenant -> (engine index, session, idle)
        for i, got in enumerate(read):
            if isinstance(got, REDIS_FAILURES):
                skipped.add(engines[i])
                continue
            if isinstance(got, BaseException):
                raise got
            live, idlers = got[0], {text(m) for m in got[1]}
            for m in live:
                tenant, session = parse_member(text(m))
                members.setdefault(tenant, []).append((i, session, text(m) in idlers))

        def records(tenant: str) -> tuple[str, list[str]]:
            keys = []
            for _, session, _ in members[tenant]:
                keys += [self.keys.session(tenant, session), self.keys.lock(tenant, session)]
            return "occupants", keys

        tenants = list(members)
        replies = await gathered([records(t) for t in tenants]) if tenants else []
        rows = []
        for tenant, got in zip(tenants, replies, strict=True):
            if isinstance(got, REDIS_FAILURES):
                skipped.update(engines[i] for i, _, _ in members[tenant])
                continue
            if isinstance(got, BaseException):
                raise got
            for (i, session, idle), line in zip(members[tenant], got, strict=True):
                rows.append([str(i + 1), tenant, session, *text(line).split("\t"), "1" if idle else "0"])
        return [r for r in rows if engines[int(r[0]) - 1] not in skipped]

    async def _evaluated(
        self, command: str, calls: list[tuple[str, list[str]]], scripts: dict[str, str]
    ) -> list[Any]:
        """One pipeline: each call's script over its keys, ``scripts`` giving it by name, as its
        SHA (``command`` evalsha) or its body (eval)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for name, keys in calls:
                getattr(pipe, command)(scripts[name], len(keys), *keys)
            return list(await pipe.execute())

    async def tenant_live_sessions(self, tenant: str) -> dict[str, str]:
        """The tenant's live sessions and the engine each is live on (O(its live sessions))."""
        async with redis_errors():
            found = await self._redis.hgetall(self.keys.tenant_live(tenant))
        return {text(s): text(e) for s, e in found.items()}

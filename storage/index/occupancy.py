"""Reads of the engines' session sets: which sessions are live on an engine, and its idle LRU.

Each engine has a SET of the ``tenant:session`` members live in its slots (busy or idle) and a
ZSET of those idle, scored by last use: the eviction order. :class:`storage.index.session_index.SessionIndex`
keeps both in step with the records inside its transitions; this mixin only reads them, in one
round trip for pool views.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from storage.index.keyspace import Keyspace, parse_member, redis_errors, text
from storage.index.records import SessionState

_OCCUPANT_FIELDS = ("state", "engine", "slot", "last_used")

# KEYS: each engine's live SET and idle ZSET, in pairs. ARGV[1]: the tenant key prefix
# (`Keyspace.tenant("")` without the tenant), so that records and locks are found as the Keyspace
# names them (`{prefix}:t:{tenant}:s:{session}`, `...:lock:{session}`). One line per live session:
# engine index, tenant, session, state, engine, slot, last_used, lock owner, 1 if idle; tab-separated.
_SLOTS = """
local out = {}
for i = 1, #KEYS, 2 do
  local idle = {}
  for _, m in ipairs(redis.call('ZRANGE', KEYS[i + 1], 0, -1)) do idle[m] = true end
  for _, m in ipairs(redis.call('SMEMBERS', KEYS[i])) do
    local sep = string.find(m, ':', 1, true)
    local tenant, session = string.sub(m, 1, sep - 1), string.sub(m, sep + 1)
    local base = ARGV[1] .. tenant
    local rec = redis.call('HMGET', base .. ':s:' .. session, 'state', 'engine', 'slot', 'last_used')
    local owner = redis.call('GET', base .. ':lock:' .. session)
    out[#out + 1] = table.concat({(i + 1) / 2, tenant, session, rec[1] or '', rec[2] or '', rec[3] or '',
      rec[4] or '', owner or '', idle[m] and '1' or '0'}, '\t')
  end
end
return out
"""


@dataclass(frozen=True)
class Occupant:
    """A session as a pool view sees it: a few fields of its record and its lock's owner."""

    live: bool
    engine: str | None
    slot: int | None
    last_used: float
    owner: str | None


class EngineOccupancy:
    """The engine-LRU reads of :class:`storage.index.session_index.SessionIndex` (a mixin: it uses the index's
    client and keyspace)."""

    _redis: Any
    keys: Keyspace
    _scripts: dict[str, Any]

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
        self, engines: Sequence[str]
    ) -> list[tuple[str, tuple[str, str], Occupant | None, bool]]:
        """Every session live on these engines — (engine, (tenant, session), its occupant fields
        or None without a record, idle?) — in ONE command (a script), whatever their number:
        a pool view's whole read."""
        if not engines:
            return []
        keys = [k for e in engines for k in (self.keys.engine_live(e), self.keys.engine_idle(e))]
        script = self._scripts.get("slots") or self._scripts.setdefault(
            "slots", self._redis.register_script(_SLOTS)
        )
        async with redis_errors():
            lines = await script(keys=keys, args=[self.keys.tenant_prefix()])
        found = []
        for line in lines:
            i, tenant, session, state, engine, slot, last_used, owner, idle = text(line).split("\t")
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

    async def tenant_live_engines(self, tenant: str) -> set[str]:
        """The engines holding the tenant's live sessions (O(its live sessions))."""
        async with redis_errors():
            return {text(e) for e in await self._redis.hvals(self.keys.tenant_live(tenant))}

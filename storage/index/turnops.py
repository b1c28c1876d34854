"""The request path's Redis work, one round trip per step: a warm turn makes two (1 and 3).

1. :meth:`TurnOps.start_turn` — one script: count the request in the tenant's rate window, take
   one of its in-flight places, try the session's lock (or confirm the caller's own, a lock this
   process kept from the session's previous turn), and read the session record, the tenant's
   session count and stored bytes, the engine registry's epoch and the index's epochs (what
   admission, quotas, placement and healing decide on). A session live in its slot, whose lock the
   request now holds, is marked busy in the same script (out of its engine's idle LRU, last used
   now, dirty): what :meth:`storage.index.session_index.SessionIndex.decide_live` would write for
   the same engine and slot, so a turn served on its live slot writes nothing more before it runs.
2. :meth:`TurnOps.apply` — one script: a record transition decided in Python (the same pure
   ``decide`` functions as :meth:`storage.index.session_index.SessionIndex._change`) against the record the
   caller read, written with its index updates only if the record is still exactly that one and
   the caller's lock still holds (compare-and-set). Otherwise nothing is written and the caller
   falls back to the WATCH/MULTI transaction, which re-reads. A turn placed anywhere else than its
   live slot makes its transition to live this way.
3. The same script ends the turn: the transition to idle plus the turn's other writes (prefix
   routes, usage counters, giving back the in-flight place, releasing the lock) ride along in
   ``also``, so they happen all together or, when the guard fails, not at all.

Scripts are Lua (redis-server; fakeredis with ``lupa`` in-process). Guarded writes replay a list
of plain commands recorded by :class:`Ops`; every key they touch is passed in ``KEYS``, except the
opening script's busy mark, which learns the engine from the record it reads and builds that
engine's two keys.

On Redis Cluster (the index's ``split``) every script holds one tenant's keys only (one hash
slot): the engines' set writes go beside it (:mod:`storage.index.occupancy`), and the global keys
the opening script reads on one primary (the registry's epoch, the index's epochs) are read at
most every :data:`GLOBALS_TTL_S` per process instead, beside the script — a poll, so that no turn
waits on the one slot every tenant shares.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from storage.errors import LockLost
from storage.index.keyspace import IDLE, LIVE, REDIS_FAILURES, Keyspace, member, redis_errors, text
from storage.index.locks import TURN, SessionLock, new_token
from storage.index.occupancy import OccupancyWrites
from storage.index.prefix_digests import ROUTES_LUA
from storage.index.records import SessionRecord, checked
from storage.index.scripts import IndexScripts

# KEYS: rate window ('' slot unused when no limit), in-flight zset, lock, record, sessions zset,
# stored bytes, then on one primary the registry epoch, index epoch, index built epoch. ARGV: rate
# limit (-1: none), window keep ms, now ms, in-flight token, in-flight limit, in-flight ttl ms, lock
# token, lock ttl ms, the caller's own lock token ('' none), then for the busy mark ('' as
# ARGV[10]: none): last used, the engine key prefix ('': the engines' sets are written beside), the
# idle and live suffixes, the engines' member, the session id.
_START = """
local rate = -1
local limit = tonumber(ARGV[1])
if limit >= 0 then
  rate = redis.call('INCR', KEYS[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  if rate > limit then return {'rate', rate} end
end
local now, ttl = tonumber(ARGV[3]), tonumber(ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('ZADD', KEYS[2], now + ttl, ARGV[4])
local count = redis.call('ZCARD', KEYS[2])
if redis.call('PTTL', KEYS[2]) < ttl then redis.call('PEXPIRE', KEYS[2], ttl) end
if count > tonumber(ARGV[5]) then
  redis.call('ZREM', KEYS[2], ARGV[4])
  return {'inflight', count}
end
local locked = redis.call('SET', KEYS[3], ARGV[7], 'NX', 'PX', ARGV[8]) and 1 or 0
local kept, left = 0, -2
if locked == 0 then
  if ARGV[9] ~= '' and redis.call('GET', KEYS[3]) == ARGV[9] then kept = 1
  else left = redis.call('PTTL', KEYS[3]) end
end
local busy = 0
if (locked == 1 or kept == 1) and ARGV[10] ~= '' then
  local f = redis.call('HMGET', KEYS[4], 'state', 'engine', 'slot')
  if f[1] == 'live' and f[2] and f[2] ~= '' and f[3] and f[3] ~= '' then
    redis.call('HSET', KEYS[4], 'last_used', ARGV[10], 'dirty', 'True')
    redis.call('ZADD', KEYS[5], ARGV[10], ARGV[15])
    if ARGV[11] ~= '' then
      redis.call('ZREM', ARGV[11] .. f[2] .. ARGV[12], ARGV[14])
      redis.call('SADD', ARGV[11] .. f[2] .. ARGV[13], ARGV[14])
    end
    busy = 1
  end
end
local function global(i, missing)
  if KEYS[i] then return redis.call('GET', KEYS[i]) or missing end
  return missing
end
return {'ok', rate, locked, left, redis.call('HGETALL', KEYS[4]), redis.call('ZCARD', KEYS[5]),
        redis.call('GET', KEYS[6]) or '0', global(7, '0'), kept, busy, count, global(8, ''),
        global(9, '')}
"""
GLOBALS_TTL_S = 0.5  # Redis Cluster: how old the global keys a turn decides on may be (module doc)

# KEYS[1] lock, KEYS[2] record, then every key the ops touch. ARGV: lock token ('' = no lock),
# 2n, the n expected record fields and values, then ops: command, key index, argc, args... — a
# command, or ROUTES: a session's routing keys (storage.index.prefix_digests.ROUTES_LUA).
_GUARDED = (
    ROUTES_LUA
    + """
local unpack = unpack or table.unpack
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) ~= ARGV[1] then return 'lock' end
local n = tonumber(ARGV[2])
local current = redis.call('HGETALL', KEYS[2])
if #current ~= n then return 'changed' end
local expected = {}
for j = 3, 2 + n, 2 do expected[ARGV[j]] = ARGV[j + 1] end
for j = 1, #current, 2 do
  if expected[current[j]] ~= current[j + 1] then return 'changed' end
end
local i = 3 + n
while i <= #ARGV do
  local argc = tonumber(ARGV[i + 2])
  local args = {}
  for j = 1, argc do args[j] = ARGV[i + 2 + j] end
  local key = KEYS[tonumber(ARGV[i + 1])]
  if ARGV[i] == 'ROUTES' then record_routes(key, args) else redis.call(ARGV[i], key, unpack(args)) end
  i = i + 3 + argc
end
return 'ok'
"""
)


class Ops:
    """Redis writes recorded for a guarded script: the subset of a redis-py pipeline's methods the
    index's transitions queue (so the same code queues them on a pipeline or here). Keys are
    numbered in the order first used, starting with ``keys``."""

    def __init__(self, *keys: str) -> None:
        self.keys: list[str] = []
        self._number: dict[str, int] = {}
        self.args: list[str] = []
        for key in keys:
            self.key(key)

    def key(self, key: str) -> int:
        """The 1-based ``KEYS`` index of ``key``."""
        if key not in self._number:
            self.keys.append(key)
            self._number[key] = len(self.keys)
        return self._number[key]

    def _op(self, command: str, key: str, *args: Any) -> None:
        self.args += [command, str(self.key(key)), str(len(args)), *(str(a) for a in args)]

    def hset(self, key: str, mapping: Mapping[str, Any]) -> None:
        self._op("HSET", key, *(x for kv in mapping.items() for x in kv))

    def hdel(self, key: str, *fields: str) -> None:
        self._op("HDEL", key, *fields)

    def hincrby(self, key: str, field: str, amount: int) -> None:
        self._op("HINCRBY", key, field, int(amount))

    def zadd(self, key: str, mapping: Mapping[str, float]) -> None:
        self._op("ZADD", key, *(x for m, score in mapping.items() for x in (repr(float(score)), m)))

    def zrem(self, key: str, *members: str) -> None:
        self._op("ZREM", key, *members)

    def sadd(self, key: str, *members: str) -> None:
        self._op("SADD", key, *members)

    def srem(self, key: str, *members: str) -> None:
        self._op("SREM", key, *members)

    def set(self, key: str, value: Any, px: int | None = None) -> None:
        self._op("SET", key, value, *(() if px is None else ("PX", int(px))))

    def pexpire(self, key: str, ms: int) -> None:
        self._op("PEXPIRE", key, int(ms))

    def routes(self, key: str, *args: Any) -> None:
        """A session's routing keys recorded in its set ``key`` (storage.index.prefix_digests:
        ``record_routes`` and its arguments; the keys it points are built from the set's slot)."""
        self._op("ROUTES", key, *args)

    def delete(self, *keys: str) -> None:
        for key in keys:
            self._op("DEL", key)


@dataclass(frozen=True)
class TurnStart:
    """What :meth:`TurnOps.start_turn` found. ``refused``: 'rate' or 'inflight' (nothing else was
    read, no place or lock taken), else ''."""

    refused: str = ""
    count: int = 0  # the rate window's or the in-flight set's count when refused
    rate: int = -1  # admitted: the rate window's count with this request (-1: no limit, not counted)
    inflight: int = 0  # admitted: the tenant's in-flight places with this request's
    inflight_token: str = ""
    lock: SessionLock | None = None  # taken; None: another owner holds it (or it is the caller's own)
    kept: bool = False  # the caller's own lock (``own_lock``) still holds
    lock_left_s: float | None = None  # another holder's remaining TTL (None: unlocked, or kept)
    record: SessionRecord | None = None  # as the script left it
    busy: bool = False  # the record was live in its slot: the script marked it busy there
    sessions: int = 0  # the tenant's sessions
    stored_bytes: int = 0
    registry_epoch: int = 0
    index_epoch: str = ""  # the index's epoch and built epoch ('' missing: storage.index.epoch)
    index_built: str = ""


def _ms(seconds: float) -> int:
    if not seconds > 0 or math.isinf(seconds):
        raise ValueError("a TTL must be a finite number of seconds > 0")
    return max(1, round(seconds * 1000))


class TurnOps(IndexScripts):
    """The one-round-trip steps of :class:`storage.index.session_index.SessionIndex` (a mixin: it uses the
    index's client, keyspace, clock and transition writes)."""

    keys: Keyspace
    _clock: Callable[[], float]
    split: bool
    _globals: tuple[float, list[Any]] | None
    # provided by SessionIndex and TenantCounters
    _window: Callable[[str, str, float], tuple[str, int]]
    _queue: Callable[
        [Any, SessionRecord | None, SessionRecord | None, str, str, bool | None, OccupancyWrites | None], None
    ]
    _above_floor: Callable[[SessionRecord], None]

    async def _read_globals(self) -> list[Any]:
        """Redis Cluster: the registry's epoch and the index's epochs (one slot, ``{g}``), read again
        when the last read is older than :data:`GLOBALS_TTL_S` (see the module doc)."""
        now = time.monotonic()
        if self._globals is None or now - self._globals[0] > GLOBALS_TTL_S:
            keys = [self.keys.registry_epoch(), self.keys.index_epoch(), self.keys.index_built()]
            try:
                self._globals = (now, list(await self._redis.mget(keys)))
            except REDIS_FAILURES:
                if self._globals is None:
                    raise
                # their shard is away: the turns of tenants elsewhere go on with what was read last
        return self._globals[1]

    async def start_turn(
        self,
        tenant: str,
        session: str,
        *,
        lock_ttl_s: float,
        inflight_limit: int,
        inflight_ttl_s: float,
        rpm_limit: int | None = None,
        own_lock: SessionLock | None = None,
        mark_busy: bool = True,
    ) -> TurnStart:
        """Admission and the session's state in one round trip (see the module doc). A refused
        request takes nothing; otherwise the caller owns the in-flight token (give it back with
        ``release_inflight`` or in ``apply(..., also=)``) and the lock when it was taken.
        ``own_lock``: the session's lock as the caller already holds it (``kept`` says whether it
        still does). ``mark_busy``: with the lock held, a record live in its slot is marked busy
        there (``busy``); a caller that then serves the turn elsewhere writes that placement over
        it, and one that fails before the turn runs puts the session back into its idle LRU."""
        if isinstance(inflight_limit, bool) or not isinstance(inflight_limit, int) or inflight_limit < 1:
            raise ValueError("inflight_limit must be an int >= 1")
        window, keep_ms = self._window(tenant, "rpm", 60) if rpm_limit is not None else ("", 0)
        now = float(self._clock())
        now_ms = round(now * 1000)
        token, lock_token = secrets.token_hex(16), new_token(TURN)
        since = time.monotonic()  # before the lock is asked for: held at least until since + TTL
        keys = [
            window or self.keys.inflight(tenant),  # unused by the script without a limit
            self.keys.inflight(tenant),
            self.keys.lock(tenant, session),
            self.keys.session(tenant, session),
            self.keys.sessions(tenant),
            self.keys.stored_bytes(tenant),
        ]
        if not self.split:
            keys += [self.keys.registry_epoch(), self.keys.index_epoch(), self.keys.index_built()]
        if own_lock is not None and (own_lock.tenant, own_lock.session) != (tenant, session):
            raise ValueError("the lock belongs to another session")
        args = [
            -1 if rpm_limit is None else int(rpm_limit),
            keep_ms,
            now_ms,
            token,
            inflight_limit,
            _ms(inflight_ttl_s),
            lock_token,
            _ms(lock_ttl_s),
            own_lock.token if own_lock else "",
        ]
        if mark_busy:
            engine_prefix = "" if self.split else self.keys.occupancy_prefix()
            args += [str(now), engine_prefix, IDLE, LIVE, member(tenant, session), session]
        else:
            args += [""]
        async with redis_errors():
            if self.split:
                reply, found = await asyncio.gather(
                    self._script("start", _START)(keys=keys, args=args), self._read_globals()
                )
            else:
                reply = await self._script("start", _START)(keys=keys, args=args)
        status = text(reply[0])
        if status != "ok":
            return TurnStart(refused=status, count=int(reply[1]))
        _, rate, locked, left_ms, raw, sessions, stored, epoch, kept, busy, inflight, index, built = reply
        flat = [text(x) for x in raw]
        fields = dict(zip(flat[::2], flat[1::2], strict=True))
        if self.split:
            epoch, index, built = (
                text(x) if x is not None else d for x, d in zip(found, ("0", "", ""), strict=True)
            )
            if int(busy):  # the engines' sets, beside the script
                engine = fields.get("engine", "")
                writes = OccupancyWrites()
                writes.zrem(self.keys.engine_idle(engine), member(tenant, session))
                writes.sadd(self.keys.engine_live(engine), member(tenant, session))
                await writes.run(self._redis, writes.removes + writes.adds)
        left = None if int(left_ms) == -2 else (math.inf if int(left_ms) == -1 else int(left_ms) / 1000)
        return TurnStart(
            rate=int(rate),
            inflight=int(inflight),
            inflight_token=token,
            lock=SessionLock(tenant, session, lock_token, lock_ttl_s, since) if int(locked) else None,
            kept=bool(int(kept)),
            lock_left_s=left,
            record=SessionRecord.from_hash(tenant, session, fields) if fields else None,
            busy=bool(int(busy)),
            sessions=int(sessions),
            stored_bytes=int(text(stored)),
            registry_epoch=int(text(epoch)),
            index_epoch=text(index),
            index_built=text(built),
        )

    async def apply(
        self,
        old: SessionRecord,
        decide: Callable[[SessionRecord | None], SessionRecord],
        *,
        lock: SessionLock | None,
        idle: bool | None = None,
        also: Callable[[Ops], None] | None = None,
    ) -> SessionRecord | None:
        """Write ``decide(old)`` (and its indexes, and ``also``'s writes) in one round trip if the
        record is still ``old`` and ``lock`` still holds. None when the record changed meanwhile:
        nothing was written; fall back to the transaction (``SessionIndex._change``).
        :class:`LockLost` when the lock is gone. ``decide`` may raise to refuse the transition."""
        tenant, session = old.tenant, old.session
        if lock is not None and (lock.tenant, lock.session) != (tenant, session):
            raise ValueError("the lock belongs to another session")
        new = decide(old)
        checked(old, new)
        if new.generation != old.generation:
            self._above_floor(new)
        ops = Ops(self.keys.lock(tenant, session), self.keys.session(tenant, session))
        beside = OccupancyWrites() if self.split else None
        self._queue(ops, old, new, tenant, session, idle, beside)
        if also is not None:
            also(ops)
        expected = [x for kv in old.to_hash().items() for x in kv]
        args = [lock.token if lock is not None else "", len(expected), *expected, *ops.args]
        if beside is not None:
            await beside.run(self._redis, beside.adds)
        async with redis_errors():
            status = text(await self._script("guarded", _GUARDED)(keys=ops.keys, args=args))
        if beside is not None and status == "ok":
            await beside.run(self._redis, beside.removes)
        if status == "lock":
            raise LockLost(f"lock on session {session} is no longer held by this owner")
        return new if status == "ok" else None

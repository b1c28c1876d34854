"""Per-tenant counters for quotas and admission: lifetime usage, windowed rates, requests in flight.

* **Usage** — a hash of lifetime counters (``prompt_tokens``, ``requests``...), never expiring.
* **Windows** — one integer key per (counter, window length, window number), ``INCRBY`` and
  ``PEXPIRE`` in the same MULTI: a fixed-window rate counter whose key disappears one window after
  its window ended, so nothing accumulates (windows are numbered ``floor(now / window)``).
* **In flight** — a ZSET of request tokens scored by their expiry. Admission is one MULTI —
  prune expired tokens, add ours, count — and a token that made the count exceed the limit is
  removed again. It never admits more than ``limit`` at once (whoever is admitted saw every token
  ahead of it); two requests racing for the last place may both be refused (the loser's token is
  counted until it is removed, one round trip later). A gateway that dies holding places loses
  them when their TTL passes: no cleanup job is needed. The key itself expires with its newest
  token (PEXPIRE NX, then GT: Redis 7+).

Clocks: expiries use the owner's injectable clock (wall time by default); gateways must agree on
time to well within the TTLs they use (NTP does).
"""

from __future__ import annotations

import math
import re
import secrets
from collections.abc import Callable, Mapping
from typing import Any

from storage.errors import InvalidId
from storage.index.keyspace import Keyspace, redis_errors, text_map

_COUNTER = re.compile(r"[a-z][a-z0-9_]{0,63}")
_TOKEN = re.compile(r"[0-9a-f]{32}")


def validate_counter(name: str) -> str:
    if not isinstance(name, str) or not _COUNTER.fullmatch(name):
        raise InvalidId("usage counter", f"{name!r} must match {_COUNTER.pattern}")
    return name


def _ms(seconds: float, what: str) -> int:
    if not seconds > 0 or math.isinf(seconds):
        raise ValueError(f"{what} must be a finite number of seconds > 0")
    return max(1, round(seconds * 1000))


class TenantCounters:
    """The counters part of :class:`storage.index.session_index.SessionIndex` (a mixin: it uses the index's
    client, keyspace and clock)."""

    _redis: Any
    keys: Keyspace
    _clock: Callable[[], float]

    # ------------------------------------------------------------------------------------ lifetime
    async def incr_usage(self, tenant: str, counters: Mapping[str, int]) -> dict[str, int]:
        """Add to the tenant's lifetime counters atomically; returns their new values."""
        names = [validate_counter(n) for n in counters]
        async with redis_errors(), self._redis.pipeline(transaction=True) as pipe:
            self.queue_usage(pipe, tenant, counters)
            values = await pipe.execute()
        return dict(zip(names, (int(v) for v in values), strict=True))

    def queue_usage(self, pipe: Any, tenant: str, counters: Mapping[str, int]) -> None:
        """:meth:`incr_usage`'s writes, queued on a pipeline in MULTI or on
        :class:`storage.index.turnops.Ops`."""
        for name in counters:
            pipe.hincrby(self.keys.usage(tenant), validate_counter(name), int(counters[name]))

    def queue_release_inflight(self, pipe: Any, tenant: str, token: str) -> None:
        """:meth:`release_inflight`'s write, queued (see :meth:`queue_usage`)."""
        if not isinstance(token, str) or not _TOKEN.fullmatch(token):
            raise InvalidId("in-flight token", "must be what acquire_inflight returned")
        pipe.zrem(self.keys.inflight(tenant), token)

    async def usage(self, tenant: str) -> dict[str, int]:
        """The tenant's lifetime counters."""
        async with redis_errors():
            raw = await self._redis.hgetall(self.keys.usage(tenant))
        return {k: int(v) for k, v in text_map(raw).items()}

    # ------------------------------------------------------------------------------------- windows
    def _window(self, tenant: str, name: str, window_s: float) -> tuple[str, int]:
        """(key of the current window, ms until one window after it ends)."""
        window_ms = _ms(window_s, "window")
        now_ms = self._clock() * 1000
        number = int(now_ms // window_ms)
        keep_ms = max(1, math.ceil((number + 2) * window_ms - now_ms))
        return self.keys.window(tenant, validate_counter(name), window_ms, number), keep_ms

    async def incr_window(self, tenant: str, name: str, window_s: float, by: int = 1) -> int:
        """Add ``by`` to counter ``name`` of the current ``window_s`` window (number
        ``floor(now / window_s)``); returns its new value. The key expires one window after its
        window ends, so nothing accumulates."""
        key, keep_ms = self._window(tenant, name, window_s)
        async with redis_errors(), self._redis.pipeline(transaction=True) as pipe:
            pipe.incrby(key, int(by))
            pipe.pexpire(key, keep_ms)
            value, _ = await pipe.execute()
        return int(value)

    async def window_count(self, tenant: str, name: str, window_s: float) -> int:
        """The current window's value of ``name`` (0 when nothing was counted yet)."""
        key, _ = self._window(tenant, name, window_s)
        async with redis_errors():
            value = await self._redis.get(key)
        return int(value or 0)

    # ----------------------------------------------------------------------------------- in flight
    async def acquire_inflight(self, tenant: str, limit: int, *, ttl_s: float) -> str | None:
        """Take one of the tenant's ``limit`` in-flight places for at most ``ttl_s``: a token for
        :meth:`release_inflight`, or None when ``limit`` places are held (answer 429). A place
        whose holder never gives it back (its gateway died) lapses after ``ttl_s``."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError("limit must be an int >= 1")
        key, ttl_ms = self.keys.inflight(tenant), _ms(ttl_s, "ttl")
        now_ms = round(self._clock() * 1000)
        token = secrets.token_hex(16)
        async with redis_errors():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.zremrangebyscore(key, "-inf", now_ms)
                pipe.zadd(key, {token: now_ms + ttl_ms})
                pipe.zcard(key)
                pipe.pexpire(key, ttl_ms, nx=True)
                pipe.pexpire(key, ttl_ms, gt=True)
                count = (await pipe.execute())[2]
            if int(count) <= limit:
                return token
            await self._redis.zrem(key, token)
        return None

    async def release_inflight(self, tenant: str, token: str) -> None:
        """Give a place back (idempotent: releasing a lapsed or released token is not an error)."""
        async with redis_errors(), self._redis.pipeline(transaction=False) as pipe:
            self.queue_release_inflight(pipe, tenant, token)
            await pipe.execute()

    async def inflight_count(self, tenant: str) -> int:
        """Places held and not lapsed (for metrics)."""
        now_ms = round(self._clock() * 1000)
        async with redis_errors():
            return int(await self._redis.zcount(self.keys.inflight(tenant), f"({now_ms}", "+inf"))

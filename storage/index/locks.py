"""Per-session locks on Redis: TTL, owner tokens, and fencing of index writes.

A lock is ``SET key token NX PX ttl``. Only the owner's token releases or extends it (compare in a
WATCH/MULTI transaction), so after a holder dies and the TTL lets a new owner in, the stale
holder's release and extend raise :class:`LockLost` instead of touching the new owner's lock.
Index changes can present the lock too (``lock=`` in :class:`storage.index.session_index.SessionIndex`), which
fences a stale holder's writes the same way.

Holders: a token starts with what holds the lock — a turn running on the session (``TURN``: a
request for the session meanwhile may fork it), or the gateway's own work on it (``WORK``: an
eviction, a delete; a request waits for it, since there is no running state to fork from).
:meth:`SessionLocks.holder` tells them apart; a token without a kind (an older release's) counts
as a turn's.

Short TTLs and renewal: a holder that works longer than the TTL renews with :meth:`SessionLocks.extend`
every ``ttl/3`` (three round trips, no Lua: it runs the same on the in-process Redis). A holder that
died simply stops renewing, so its lock lapses within one TTL; :meth:`SessionLocks.holder` tells
a live holder (always above two thirds of its TTL) from a dead one (below), and ``acquire(wait_s=…)``
with ``wait_s`` a little over the remaining time takes the lock as soon as it lapses.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import structlog

from storage.errors import LockBusy, LockLost
from storage.ids import validate_id
from storage.index.keyspace import Keyspace, redis_errors, text, transact

log = structlog.get_logger("slotkeeper.storage")


TURN = "turn"  # the kinds of holder a lock's token names (see the module doc)
WORK = "work"


def new_token(holder: str) -> str:
    """A fresh owner token of a ``holder`` kind (TURN or WORK)."""
    return f"{holder}-{secrets.token_hex(16)}"


def holder_of(token: str) -> str:
    """The holder kind a token names; TURN for a token without one. Pure."""
    kind, sep, _ = token.partition("-")
    return kind if sep and kind in (TURN, WORK) else TURN


@dataclass(frozen=True)
class SessionLock:
    """Proof of ownership of one session's lock until ``ttl_s`` after the last acquire/extend.

    ``since`` is this process's ``time.monotonic()`` just before the acquire was sent (0: not
    known): Redis set the TTL after that, so the lock is certainly held until ``since + ttl_s``
    unless it is released (what :class:`gateway.turn.hold.SessionHold` counts on to start a turn
    before its opening read confirms the lock)."""

    tenant: str
    session: str
    token: str
    ttl_s: float
    since: float = 0.0


async def check_owner(pipe: Any, keys: Keyspace, lock: SessionLock | None) -> None:
    """Inside a transaction that WATCHes ``keys.lock(...)``: raise LockLost unless ``lock`` holds."""
    if lock is None:
        return
    current = await pipe.get(keys.lock(lock.tenant, lock.session))
    if current is None or text(current) != lock.token:
        raise LockLost(f"lock on session {lock.session} is no longer held by this owner")


def _ms(seconds: float) -> int:
    if seconds <= 0:
        raise ValueError("ttl must be > 0")
    return max(1, round(seconds * 1000))


class SessionLocks:
    """Locks of sessions, one per (tenant, session).

    ``monotonic`` and ``sleep`` pace :meth:`acquire`'s waiting (tests may inject them); TTLs are
    always Redis's own.
    """

    def __init__(
        self,
        redis: Any,
        *,
        prefix: str = "slotkeeper",
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._redis = redis
        self.keys = Keyspace(prefix)
        self._monotonic = monotonic
        self._sleep = sleep

    async def try_acquire(
        self, tenant: str, session: str, *, ttl_s: float, holder: str = WORK
    ) -> SessionLock | None:
        """The lock for a ``holder`` (TURN or WORK), or None when another owner holds it."""
        key = self.keys.lock(tenant, session)
        token = new_token(holder)
        since = time.monotonic()
        async with redis_errors():
            ok = await self._redis.set(key, token, nx=True, px=_ms(ttl_s))
        if not ok:
            return None
        log.debug("lock.acquired", tenant=tenant, session=session, ttl_s=ttl_s)
        return SessionLock(tenant, session, token, ttl_s, since)

    async def acquire(
        self,
        tenant: str,
        session: str,
        *,
        ttl_s: float,
        wait_s: float = 0.0,
        poll_s: float = 0.05,
        holder: str = WORK,
    ) -> SessionLock:
        """The lock for a ``holder``, trying every ``poll_s`` for up to ``wait_s`` (a last try at the
        deadline); :class:`LockBusy` when it stays held."""
        if poll_s <= 0:
            raise ValueError("poll_s must be > 0")
        deadline = self._monotonic() + wait_s
        while True:
            lock = await self.try_acquire(tenant, session, ttl_s=ttl_s, holder=holder)
            if lock is not None:
                return lock
            left = deadline - self._monotonic()
            if left <= 0:
                raise LockBusy(f"session {validate_id(session, 'session id')} is locked by another request")
            await self._sleep(min(poll_s, left))

    async def release(self, lock: SessionLock) -> None:
        """Release; :class:`LockLost` when the lock expired or belongs to someone else now."""
        key = self.keys.lock(lock.tenant, lock.session)

        async def body(pipe: Any) -> None:
            await check_owner(pipe, self.keys, lock)
            pipe.multi()
            pipe.delete(key)

        await transact(self._redis, [key], body)
        log.debug("lock.released", tenant=lock.tenant, session=lock.session)

    async def extend(self, lock: SessionLock, ttl_s: float | None = None) -> SessionLock:
        """Push the expiry ``ttl_s`` (default: the lock's TTL) from now; :class:`LockLost` if the
        lock lapsed or has another owner (stop working then: writes fenced by it fail too). A
        :class:`StoreUnavailable` is worth retrying at the next renewal tick. Returns the lock with
        its new TTL and ``since``."""
        key = self.keys.lock(lock.tenant, lock.session)
        ttl = lock.ttl_s if ttl_s is None else ttl_s
        since = time.monotonic()

        async def body(pipe: Any) -> None:
            await check_owner(pipe, self.keys, lock)
            pipe.multi()
            pipe.pexpire(key, _ms(ttl))

        await transact(self._redis, [key], body)
        return replace(lock, ttl_s=ttl, since=since)

    async def holder(self, tenant: str, session: str) -> tuple[str | None, float | None]:
        """What holds the lock (TURN or WORK) and the seconds until it lapses unless renewed, in one
        round trip; (None, None) when unlocked."""
        key = self.keys.lock(tenant, session)
        async with redis_errors():
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.get(key)
                pipe.pttl(key)
                value, ms = await pipe.execute()
        if value is None or int(ms) == -2:
            return None, None
        return holder_of(text(value)), float("inf") if int(ms) == -1 else int(ms) / 1000

    async def owner(self, tenant: str, session: str) -> str | None:
        """The current owner token (for diagnostics), or None when unlocked."""
        async with redis_errors():
            value = await self._redis.get(self.keys.lock(tenant, session))
        return None if value is None else text(value)

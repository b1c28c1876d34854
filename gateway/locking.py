"""A turn's hold on its session's lock: taken, taken over, waited for — or, while a request runs
on the session, a fork of it under a fresh id.

Only a turn running on the session is forked around: the lock's token says what holds it
(storage.index.locks), and the gateway's own work on a session — an eviction saving it, a delete —
is waited for (there is no running state to fork from, and a fork would start the conversation
anew). A live holder renews its lock every third of the TTL (gateway.holds), so a turn's lock
found below half its TTL was not renewed in time: its gateway died. `wait_or_fork` decides from
those two alone whether to wait for the lock or fork its session; the rest of `_lock` gathers what
it needs, cheapest question first.
"""

from __future__ import annotations

import contextlib

from gateway.holds import Phase, SessionHold
from gateway.turn import fork_id
from gateway.turn_parts import TurnParts
from storage.errors import LockBusy
from storage.index.locks import TURN, WORK, SessionLock
from storage.index.turnops import TurnStart


def wait_or_fork(
    holder: str | None, remaining_s: float | None, lock_ttl_s: float, work_wait_s: float
) -> float | None:
    """How long to wait for a lock another process holds on a session that is busy (None: fork
    it). The gateway's work (``WORK``) is waited for ``work_wait_s``. A turn that renews keeps its
    lock above two thirds of the TTL, so one at half or above is alive: forked around; below, it
    died: wait for its lock to lapse, never fork."""
    if holder == WORK:
        return work_wait_s
    if remaining_s is not None and remaining_s >= lock_ttl_s / 2:
        return None
    return (remaining_s or 0.0) + 1.0


async def hold_for_turn(parts: TurnParts, tenant: str, session: str, start: TurnStart) -> SessionHold | None:
    """The session's lock for this turn when this process did not hold it already: taken by the
    opening read, taken over from this process's own previous turn of the session (one that began
    settling meanwhile), or waited for; None when a request runs on it (the caller forks)."""
    if start.lock is not None:
        return parts.holds.start(start.lock, start.record)
    own = parts.holds.get(tenant, session)
    if own is not None and await parts.holds.take_over(own):
        return own
    lock = await _lock(parts, tenant, session)
    return None if lock is None else parts.holds.start(lock, None)


async def fork(parts: TurnParts, tenant: str, session: str) -> tuple[str, SessionHold]:
    """A fork of the busy session: a fresh id (gateway.turn.fork_id), locked and held for the turn."""
    forked = fork_id(session)
    lock = await parts.locks.try_acquire(tenant, forked, ttl_s=parts.settings.lock_ttl_s, holder=TURN)
    assert lock is not None
    return forked, parts.holds.start(lock, None)


async def _lock(parts: TurnParts, tenant: str, session: str) -> SessionLock | None:
    """The session's lock, waiting where its holder is only settling or dead; None when a live
    request holds it (the caller forks)."""
    ttl_s, spill_wait_s = parts.settings.lock_ttl_s, parts.settings.spill_wait_s
    lock = await parts.locks.try_acquire(tenant, session, ttl_s=ttl_s, holder=TURN)
    if lock is not None:
        return lock
    own = parts.holds.get(tenant, session)
    wait: float | None
    if own is not None:  # our own: a turn runs on it (fork), or it is being released (wait)
        if own.phase is Phase.RUNNING:
            return None
        wait = spill_wait_s
    elif await parts.index.find(tenant, session) is None or await parts.index.is_idle(tenant, session):
        # No request runs on it: a delete, an eviction or another replica's save of its last turn
        # holds the lock a moment. There is nothing to fork from anyway: wait.
        wait = spill_wait_s
    else:
        wait = wait_or_fork(*await parts.locks.holder(tenant, session), ttl_s, spill_wait_s)
        if wait is None:
            return None
    with contextlib.suppress(LockBusy):
        return await parts.locks.acquire(tenant, session, ttl_s=ttl_s, wait_s=wait, holder=TURN)
    return None

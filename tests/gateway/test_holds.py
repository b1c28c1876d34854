"""gateway.holds: a turn's write-behind save starts after a grace, so that a next turn sent at
once runs first and only the newest save runs; without a grace each save asked for runs."""

from __future__ import annotations

import asyncio
import functools

from gateway.holds import Holds
from storage.keyspace import in_process_redis
from storage.locks import SessionLocks


async def _saves_run(grace_s: float) -> list[str]:
    redis = in_process_redis()
    locks = SessionLocks(redis)
    holds = Holds(locks, lock_ttl_s=15.0, save_grace_s=grace_s)
    lock = await locks.try_acquire("acme", "s1", ttl_s=15.0)
    assert lock is not None
    hold = holds.start(lock, None)
    ran: list[str] = []

    async def save(name: str) -> None:
        ran.append(name)

    holds.saving(hold, functools.partial(save, "first turn's"))
    for _ in range(3):  # the save task starts (and, without a grace, runs)
        await asyncio.sleep(0)
    holds.saving(hold, functools.partial(save, "next turn's"))  # a next turn answered at once
    await holds.let_go(hold)  # the turns are done; the saves hold the lock until they end
    await asyncio.wait_for(hold.released, 10)
    assert await locks.try_acquire("acme", "s1", ttl_s=15.0) is not None  # released
    await redis.aclose()
    return ran


async def test_a_save_asked_for_again_within_its_grace_runs_once_the_newest() -> None:
    assert await _saves_run(0.2) == ["next turn's"]


async def test_without_a_grace_every_save_runs_in_order() -> None:
    assert await _saves_run(0.0) == ["first turn's", "next turn's"]

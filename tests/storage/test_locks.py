"""storage.locks on a real redis-server and on the in-process default."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from storage.errors import InvalidId, LockBusy, LockLost
from storage.locks import SessionLocks


@pytest.fixture
def locks(redis_client: Any) -> SessionLocks:
    return SessionLocks(redis_client, prefix="sk")


async def test_acquire_release(locks: SessionLocks) -> None:
    lock = await locks.acquire("acme", "s", ttl_s=5)
    assert await locks.owner("acme", "s") == lock.token
    assert await locks.try_acquire("acme", "s", ttl_s=5) is None
    with pytest.raises(LockBusy):
        await locks.acquire("acme", "s", ttl_s=5, wait_s=0.1, poll_s=0.02)
    assert await locks.try_acquire("other", "s", ttl_s=5) is not None  # another tenant's namesake
    await locks.release(lock)
    assert await locks.owner("acme", "s") is None
    with pytest.raises(LockLost):
        await locks.release(lock)


async def test_waiter_gets_the_lock_when_released(locks: SessionLocks) -> None:
    first = await locks.acquire("acme", "s", ttl_s=5)

    async def release_soon() -> None:
        await asyncio.sleep(0.1)
        await locks.release(first)

    waiter = asyncio.create_task(locks.acquire("acme", "s", ttl_s=5, wait_s=2, poll_s=0.02))
    await release_soon()
    second = await waiter
    assert second.token != first.token and await locks.owner("acme", "s") == second.token


async def test_dead_holder_expires_and_stale_owner_is_refused(locks: SessionLocks) -> None:
    stale = await locks.acquire("acme", "s", ttl_s=0.2)
    await asyncio.sleep(0.35)  # the holder "died": no extend, the TTL runs out
    fresh = await locks.acquire("acme", "s", ttl_s=5)
    with pytest.raises(LockLost):
        await locks.extend(stale)
    with pytest.raises(LockLost):
        await locks.release(stale)
    assert await locks.owner("acme", "s") == fresh.token  # the new owner is untouched
    await locks.release(fresh)


async def test_extend_keeps_the_lock(locks: SessionLocks) -> None:
    lock = await locks.acquire("acme", "s", ttl_s=0.3)
    for _ in range(3):
        await asyncio.sleep(0.15)
        lock = await locks.extend(lock)
    assert await locks.owner("acme", "s") == lock.token
    longer = await locks.extend(lock, 10)
    assert longer.ttl_s == 10
    with pytest.raises(ValueError):
        await locks.extend(lock, 0)


async def test_ids_are_validated(locks: SessionLocks) -> None:
    for bad in ("a/b", "..", "a\0", "x" * 129, "a:b"):
        with pytest.raises(InvalidId):
            await locks.try_acquire("acme", bad, ttl_s=1)
        with pytest.raises(InvalidId):
            await locks.try_acquire(bad, "s", ttl_s=1)

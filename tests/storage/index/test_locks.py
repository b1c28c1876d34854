"""storage.index.locks on a real redis-server and on the in-process default."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from storage.errors import InvalidId, LockBusy, LockLost
from storage.index.locks import TURN, WORK, SessionLocks, holder_of


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
    # the holder "died": no extend; a waiter gets the lock as soon as the TTL runs out
    fresh = await locks.acquire("acme", "s", ttl_s=5, wait_s=5, poll_s=0.01)
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


async def test_the_holder_and_its_time_left_tell_a_renewed_turn_from_a_dead_one_and_from_work(
    locks: SessionLocks, eventually: Any
) -> None:
    assert await locks.holder("acme", "s") == (None, None)
    lock = await locks.acquire("acme", "s", ttl_s=0.6, holder=TURN)
    holder, left = await locks.holder("acme", "s")
    assert holder == TURN and left is not None and 0.5 < left <= 0.6

    async def below_half() -> bool:  # what a holder that stopped renewing looks like
        _, left = await locks.holder("acme", "s")
        return left is not None and left < 0.3

    await eventually(below_half, "the TTL runs down without renewal", timeout_s=2)
    lock = await locks.extend(lock)  # one renewal brings it back
    _, left = await locks.holder("acme", "s")
    assert left is not None and left > 0.5
    waiter = await locks.acquire("acme", "s", ttl_s=5, wait_s=left + 1, poll_s=0.02)  # holder "dies"
    assert waiter.token != lock.token and await locks.owner("acme", "s") == waiter.token
    assert (await locks.holder("acme", "s"))[0] == WORK  # an eviction's or a delete's, by default


@pytest.mark.parametrize(
    ("token", "holder"),
    [("turn-ab12", TURN), ("work-ab12", WORK), ("0f3e9a", TURN), ("other-ab", TURN), ("", TURN)],
)
def test_a_token_names_its_holder_and_an_older_one_counts_as_a_turn(token: str, holder: str) -> None:
    assert holder_of(token) == holder


async def test_a_renewal_loop_at_a_third_of_the_ttl_keeps_a_short_lock(locks: SessionLocks) -> None:
    ttl = 0.6
    lock = await locks.acquire("acme", "s", ttl_s=ttl)
    for _ in range(6):  # 1.2 s of work: twice the TTL
        await asyncio.sleep(ttl / 3)  # the renewal cadence, not a wait for the TTL
        lock = await locks.extend(lock)
        _, left = await locks.holder("acme", "s")
        assert left is not None and left > ttl / 2
    assert await locks.owner("acme", "s") == lock.token


async def test_acquire_paces_its_polls_and_tries_once_more_at_the_deadline(redis_client: Any) -> None:
    now = [0.0]
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(round(seconds, 6))
        now[0] += seconds

    locks = SessionLocks(redis_client, prefix="sk", monotonic=lambda: now[0], sleep=fake_sleep)
    held = await locks.acquire("acme", "s", ttl_s=30)
    with pytest.raises(LockBusy):
        await locks.acquire("acme", "s", ttl_s=30, wait_s=0.12, poll_s=0.05)
    assert slept == [0.05, 0.05, 0.02]  # never sleeps past the deadline
    slept.clear()
    with pytest.raises(LockBusy):
        await locks.acquire("acme", "s", ttl_s=30)  # wait_s=0: one try, no sleep
    assert slept == []
    with pytest.raises(ValueError):
        await locks.acquire("acme", "s", ttl_s=30, wait_s=1, poll_s=0)
    await locks.release(held)

"""gateway.turn.hold: a turn's write-behind save starts after a grace, so that a next turn sent at
once runs first and only the newest save runs; without a grace each save asked for runs."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import pytest

from gateway.turn.hold import Holds, Phase, enter, wait_or_fork
from storage.errors import StoreUnavailable
from storage.index.keyspace import in_process_redis
from storage.index.locks import TURN, WORK, SessionLocks


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


async def test_in_a_burst_of_turns_only_one_save_in_a_row_gives_way() -> None:
    """A next turn that takes the slot during a save's grace makes that save give way (in the
    product it finds the session busy); the save after it starts without a grace, so a burst of
    back-to-back turns still saves every other turn's state; then the grace is back."""
    redis = in_process_redis()
    locks = SessionLocks(redis)
    graces: list[float] = []
    hooks: list[asyncio.Future[None]] = []

    async def sleep(s: float) -> None:
        graces.append(s)
        if hooks:
            await hooks.pop(0)

    holds = Holds(locks, lock_ttl_s=15.0, save_grace_s=0.5, sleep=sleep)
    lock = await locks.try_acquire("acme", "s1", ttl_s=15.0)
    assert lock is not None
    hold = holds.start(lock, None)  # turn 0 runs
    ran: list[str] = []

    async def save(name: str) -> None:
        ran.append(name)

    async def answered(turn: int) -> None:  # as TurnRunner.finish: the save, the books, let go
        holds.answered(hold)
        holds.saving(hold, functools.partial(save, f"turn {turn}"))
        holds.booked(hold)
        await holds.let_go(hold)

    in_grace = asyncio.get_running_loop().create_future()
    hooks.append(in_grace)
    await answered(0)
    for _ in range(3):
        await asyncio.sleep(0)  # turn 0's save is in its grace
    assert await holds.take_over(hold)  # turn 1, sent at once, takes the slot
    in_grace.set_result(None)
    for _ in range(3):
        await asyncio.sleep(0)  # turn 0's save ends its grace with turn 1 running: it gave way
    await answered(1)
    assert await holds.take_over(hold)  # turn 2 starts at once too
    assert hold.saved is not None
    await hold.saved
    assert ran == ["turn 0", "turn 1"] and graces == [0.5]  # turn 1's save had no grace
    await answered(2)
    await hold.saved
    assert ran == ["turn 0", "turn 1", "turn 2"] and graces == [0.5, 0.5]  # the grace is back
    await asyncio.wait_for(hold.released, 10)
    await redis.aclose()


async def test_a_release_redis_missed_is_made_when_it_answers_again() -> None:
    redis = in_process_redis()
    locks = SessionLocks(redis)
    holds = Holds(locks, lock_ttl_s=15.0)
    lock = await locks.try_acquire("acme", "s1", ttl_s=15.0)
    assert lock is not None
    hold = holds.start(lock, None)
    real, failures = locks.release, [StoreUnavailable("redis: connection reset")] * 3

    async def flaky(lock: Any) -> None:
        if failures:
            raise failures.pop()
        await real(lock)

    locks.release = flaky  # type: ignore[method-assign]
    await holds.let_go(hold)  # Redis is away: the lock stays for now
    assert await locks.try_acquire("acme", "s1", ttl_s=15.0) is None
    deadline = asyncio.get_running_loop().time() + 5  # well within the lock's 15 s
    while await locks.try_acquire("acme", "s1", ttl_s=15.0) is None:
        assert asyncio.get_running_loop().time() < deadline, "not released once Redis answered"
        await asyncio.sleep(0.05)
    assert not failures
    await redis.aclose()


async def test_a_turn_no_save_follows_keeps_its_hold_a_moment_for_the_next_turn() -> None:
    """An on-evict tenant's turn: the hold lingers ``save_grace_s``; a next turn sent meanwhile
    takes it over (no lock from Redis, so it may start early), and the lock goes with the last
    user. Without a grace the lock goes with the turn."""
    redis = in_process_redis()
    locks = SessionLocks(redis)
    gate = asyncio.Event()

    async def grace(_: float) -> None:  # the linger ends when the test says so
        await gate.wait()

    holds = Holds(locks, lock_ttl_s=15.0, save_grace_s=0.1, sleep=grace)
    lock = await locks.try_acquire("acme", "s1", ttl_s=15.0, holder=TURN)
    assert lock is not None
    hold = holds.start(lock, None)
    holds.answered(hold)  # as a turn's finish does: answered, the hold kept, booked
    holds.linger(hold)
    holds.booked(hold)
    await holds.let_go(hold)  # the turn is done; the hold lingers
    assert await locks.owner("acme", "s1") == lock.token and holds.get("acme", "s1") is hold
    assert await holds.take_over(hold)  # the next turn, at once
    gate.set()  # the linger ends while that turn runs: the lock stays with it
    for _ in range(3):
        await asyncio.sleep(0)
    assert await locks.owner("acme", "s1") == lock.token and not hold.released.done()
    await holds.let_go(hold)  # the next turn ends: the last user releases
    await asyncio.wait_for(hold.released, 10)
    assert await locks.owner("acme", "s1") is None

    plain = Holds(locks, lock_ttl_s=15.0, save_grace_s=0.0)
    lock = await locks.try_acquire("acme", "s2", ttl_s=15.0, holder=TURN)
    assert lock is not None
    hold = plain.start(lock, None)
    plain.linger(hold)  # no grace: nothing lingers
    await plain.let_go(hold)
    assert await locks.owner("acme", "s2") is None
    await redis.aclose()


async def test_a_holds_phase_changes_only_as_its_table_says() -> None:
    """RUNNING -> ANSWERED -> SETTLING -> RUNNING (taken over), or RUNNING -> SETTLING (a turn that
    ended before answering); anything else is a bug and refused."""
    redis = in_process_redis()
    locks = SessionLocks(redis)
    holds = Holds(locks, lock_ttl_s=15.0)
    lock = await locks.try_acquire("acme", "s1", ttl_s=15.0)
    assert lock is not None
    hold = holds.start(lock, None)
    with pytest.raises(AssertionError, match="running -> running"):
        enter(hold, Phase.RUNNING)  # a second turn on a running hold: it forks instead
    holds.answered(hold)
    holds.booked(hold)
    assert hold.phase is Phase.SETTLING
    with pytest.raises(AssertionError, match="settling -> answered"):
        enter(hold, Phase.ANSWERED)  # an answer with no turn running
    assert await holds.take_over(hold) and hold.phase is Phase.RUNNING
    await holds.let_go(hold, turn=True)
    await holds.let_go(hold)
    await asyncio.wait_for(hold.released, 10)
    await redis.aclose()


async def test_a_lookup_waits_only_for_bookkeeping_that_may_write_what_it_looks_for() -> None:
    """`Holds.routed`: the tenant's answered turns whose routes are not known yet, or hold one the
    lookup asks for, are waited for; another conversation's, or another tenant's, are not."""
    redis = in_process_redis()
    locks = SessionLocks(redis)
    holds = Holds(locks, lock_ttl_s=15.0)

    async def answered(tenant: str, session: str, routes: list[str] | None) -> Any:
        lock = await locks.try_acquire(tenant, session, ttl_s=15.0)
        assert lock is not None
        hold = holds.start(lock, None)
        holds.answered(hold, routes)
        return hold

    other = await answered("acme", "other", ["r-other"])
    elsewhere = await answered("umbrella", "s", None)
    await asyncio.wait_for(holds.routed("acme", ["r-mine"], 60.0), 30)  # neither is waited for
    waited = []
    for session, routes in (("mine", ["r-head", "r-mine"]), ("unknown", None)):
        hold = await answered("acme", session, routes)
        lookup = asyncio.create_task(holds.routed("acme", ["r-mine"], 60.0))
        await asyncio.sleep(0)  # (a lookup with nothing to wait for is done in its first step)
        assert not lookup.done(), session
        holds.booked(hold)
        await asyncio.wait_for(lookup, 30)
        waited.append(hold)
    assert not other.booked.is_set() and not elsewhere.booked.is_set()
    for hold in (other, elsewhere, *waited):
        holds.booked(hold)
        await holds.let_go(hold)
    await redis.aclose()


@pytest.mark.parametrize(
    ("remaining_s", "wait_s"),
    [(30.0, None), (20.0, None), (19.9, 20.9), (0.0, 1.0), (None, 1.0)],
)
def test_a_renewed_turn_is_forked_around_and_a_lapsing_one_waited_for(remaining_s, wait_s) -> None:
    # TTL 40: a holder that renews every third keeps it above 26.7; below half (20) it died.
    assert wait_or_fork(TURN, remaining_s, 40.0, 5.0) == wait_s


@pytest.mark.parametrize("remaining_s", [40.0, 30.0, 1.0, None])
def test_the_gateways_own_work_on_a_session_is_waited_for_never_forked(remaining_s) -> None:
    """An eviction saving the session, a delete: there is no running state to fork from."""
    assert wait_or_fork(WORK, remaining_s, 40.0, 5.0) == 5.0

"""The index's epoch: a lost index is noticed, and exactly one process rebuilds it."""

from __future__ import annotations

import pytest

from storage.index.epoch import IndexEpoch, IndexState, Lease, index_state
from storage.index.keyspace import in_process_redis


@pytest.mark.parametrize(
    ("known", "epoch", "built", "state"),
    [
        ("e1", "e1", "e1", IndexState.READY),
        ("e1", "", "", IndexState.LOST),
        ("e1", "", "e1", IndexState.LOST),  # only the built key survived: still lost
        ("e1", "e2", "e2", IndexState.CHANGED),  # another process healed a loss this one missed
        (None, "e1", "e1", IndexState.CHANGED),
        ("e1", "e1", "", IndexState.HEALING),
        ("e2", "e2", "e1", IndexState.HEALING),
    ],
)
def test_the_verdict_on_an_epoch_read(known: str | None, epoch: str, built: str, state: IndexState) -> None:
    assert index_state(known, epoch, built) is state


async def test_the_first_claim_wins_and_a_flush_takes_the_epoch_away() -> None:
    redis = in_process_redis()
    a, b = IndexEpoch(redis, prefix="sk"), IndexEpoch(redis, prefix="sk")
    first, created = await a.claim()
    second, again = await b.claim()
    assert created and not again and first == second
    assert await a.read() == (first, "")
    await redis.flushall()
    assert await a.read() == ("", "")
    fresh, created = await b.claim()
    assert created and fresh != first


async def test_one_lease_at_a_time_and_built_only_for_the_current_epoch() -> None:
    redis = in_process_redis()
    epoch = IndexEpoch(redis, prefix="sk")
    token, _ = await epoch.claim()
    answer, lease = await epoch.take_lease(token, 60)
    assert answer is Lease.TAKEN and (await epoch.take_lease(token, 60))[0] is Lease.HELD
    assert await epoch.mark_built(token, lease)
    assert await epoch.read() == (token, token)
    # Given back with the mark, but a process that read the epoch unbuilt just before finds it
    # built when it asks, and does not rebuild it a second time.
    assert (await epoch.take_lease(token, 60))[0] is Lease.BUILT

    # Lost again during a rebuild: the old epoch is not marked built over the new one.
    await redis.flushall()
    newer, _ = await epoch.claim()
    assert (await epoch.take_lease(token, 60))[0] is Lease.MOVED  # the caller claims again
    answer, lease = await epoch.take_lease(newer, 60)
    assert answer is Lease.TAKEN
    assert not await epoch.mark_built(token, lease)
    assert await epoch.read() == (newer, "")
    await epoch.give_lease("someone-else")  # not ours: kept
    assert (await epoch.take_lease(newer, 60))[0] is Lease.HELD
    await epoch.give_lease(lease)
    assert (await epoch.take_lease(newer, 60))[0] is Lease.TAKEN

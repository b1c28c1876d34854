"""gateway.healing on the in-process Redis: a lost index is noticed, rebuilt once by one process of
several, and turns meanwhile look their sessions up in the store (tests/gateway/test_index_healing.py
does it with a real redis-server under `slotkeeper serve`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.healing import IndexHealing
from gateway.metrics import Metrics
from storage.blobs.localstore import LocalStore
from storage.index.epoch import IndexEpoch
from storage.index.keyspace import in_process_redis
from storage.index.session_index import SessionIndex


def healer(redis: Any, store: LocalStore) -> tuple[IndexHealing, Metrics]:
    metrics = Metrics()
    index = SessionIndex(redis, prefix="sk")
    return IndexHealing(IndexEpoch(redis, prefix="sk"), store, index, metrics, interval_s=0.01), metrics


def rebuilds(metrics: Metrics) -> float:
    return metrics.index_rebuilds._value.get()  # type: ignore[attr-defined,no-any-return]


async def until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Poll ``check`` until it holds (the healing runs as a task of its own)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(0.01)


async def settled(*healers: IndexHealing) -> None:
    await until(lambda: not any(h.healing for h in healers), "healed")


async def test_a_new_index_is_built_at_start_and_a_lost_one_once_by_one_of_two_gateways(
    tmp_path: Path,
) -> None:
    redis, store = in_process_redis(), LocalStore(tmp_path / "store", prefix="sk")
    (a, ma), (b, mb) = healer(redis, store), healer(redis, store)
    await a.start(wait=True)  # the first: the epoch is new, the index is built before it serves
    await b.start(wait=True)  # the second finds it built
    assert not a.healing and not b.healing and (rebuilds(ma), rebuilds(mb)) == (1, 0)
    epoch, built = await IndexEpoch(redis, prefix="sk").read()
    assert epoch == built == a.known == b.known

    await redis.flushall()  # the index is lost; both gateways see it on their next read
    lost = await IndexEpoch(redis, prefix="sk").read()
    a.saw(*lost)
    b.saw(*lost)
    assert a.healing and b.healing
    await settled(a, b)
    assert rebuilds(ma) + rebuilds(mb) == 3 - 1  # one more rebuild, by one of them
    epoch, built = await IndexEpoch(redis, prefix="sk").read()
    assert epoch and epoch == built == a.known == b.known and epoch != lost[0]


async def test_the_watcher_notices_a_loss_without_any_turn(tmp_path: Path) -> None:
    redis, store = in_process_redis(), LocalStore(tmp_path / "store", prefix="sk")
    a, metrics = healer(redis, store)
    await a.start(wait=True)
    watching = asyncio.create_task(a.watch())
    try:
        await redis.flushall()
        await until(lambda: rebuilds(metrics) == 2, "rebuilt after the loss")
        await settled(a)
    finally:
        watching.cancel()
        await a.close()


async def test_no_store_lookup_unless_healing(tmp_path: Path) -> None:
    redis, store = in_process_redis(), LocalStore(tmp_path / "store", prefix="sk")
    a, metrics = healer(redis, store)
    await a.start(wait=True)
    assert await a.recover("acme", "s1") is None and metrics.index_recovered._value.get() == 0  # type: ignore[attr-defined]

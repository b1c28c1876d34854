"""gateway.healing on the in-process Redis: a lost index is noticed, rebuilt once by one process of
several, and turns meanwhile look their sessions up in the store (tests/gateway/test_index_healing.py
does it with a real redis-server under `slotkeeper serve`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from support.redis_topology import TOPOLOGIES, topology

from engine_pool.protocol.node import UnstoredCopy
from gateway.healing import IndexHealing, behind
from gateway.metrics import Metrics
from storage.blobs.localstore import LocalStore
from storage.errors import StoreUnavailable
from storage.ids import SlotRef
from storage.index.epoch import IndexEpoch
from storage.index.keyspace import in_process_redis
from storage.index.session_index import SessionIndex, SessionState
from storage.index.topology import connect


def healer(
    redis: Any, store: LocalStore, unstored: list[UnstoredCopy] | None = None, epoch: IndexEpoch | None = None
) -> tuple[IndexHealing, Metrics]:
    metrics = Metrics()
    index = SessionIndex(redis, prefix="sk")

    async def listed(tenant: str | None, session: str | None) -> list[UnstoredCopy]:  # as a node filters
        return [c for c in unstored or () if session is None or (c.tenant, c.session) == (tenant, session)]

    epoch = epoch or IndexEpoch(redis, prefix="sk")
    return IndexHealing(epoch, store, index, metrics, interval_s=0.01, unstored=listed, wait_s=0.5), metrics


class DownStore(LocalStore):
    """A store that is away: every listing fails as S3 unreachable does."""

    async def latest(self, tenant: str, session: str) -> Any:
        raise StoreUnavailable("the store is down")

    async def list_tenants(self) -> Any:  # type: ignore[override]
        raise StoreUnavailable("the store is down")
        yield  # an async generator, as the store's own


def copy(session: str, generation: int, tokens: int) -> UnstoredCopy:
    """A generation only a node's spill cache holds."""
    key = f"sk/acme/{session}/{generation}"
    return UnstoredCopy("acme", session, generation, key, 4096, tokens, "m", 1.0)


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


@pytest.fixture(params=["in-process", *TOPOLOGIES])
async def any_redis(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """The in-process index, one primary, a Redis Cluster and a Sentinel-managed master, emptied."""
    if request.param == "in-process":
        client = in_process_redis()
    else:
        client = connect(topology(request, request.param).url, decode_responses=True)
    yield client
    await client.aclose()


async def test_a_new_index_is_built_at_start_and_a_lost_one_once_by_one_of_two_gateways(
    tmp_path: Path, any_redis: Any
) -> None:
    redis, store = any_redis, LocalStore(tmp_path / "store", prefix="sk")
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


class LateReads(IndexEpoch):
    """An epoch whose reads answer only while ``gate`` is open: held, what they read grows old."""

    def __init__(self, redis: Any, gate: asyncio.Event) -> None:
        super().__init__(redis, prefix="sk")
        self.gate, self.held = gate, 0

    async def read(self) -> tuple[str, str]:
        state = await super().read()
        self.held += 1
        await self.gate.wait()
        return state


async def test_a_gateway_that_read_the_index_unbuilt_does_not_rebuild_it_once_another_did(
    tmp_path: Path,
) -> None:
    """b reads the lost index's new epoch unbuilt; a rebuilds it, marks it built and gives the lease
    back before b asks for the lease: b finds it built, and the index is rebuilt once."""
    redis, store = in_process_redis(), LocalStore(tmp_path / "store", prefix="sk")
    gate = asyncio.Event()
    gate.set()
    late = LateReads(redis, gate)
    (a, ma), (b, mb) = healer(redis, store), healer(redis, store, epoch=late)
    await a.start(wait=True)
    await b.start(wait=True)
    assert (rebuilds(ma), rebuilds(mb)) == (1, 0)

    gate.clear()
    await redis.flushall()
    lost = await IndexEpoch(redis, prefix="sk").read()
    held = late.held
    b.saw(*lost)
    await until(lambda: late.held > held, "b's read of the new epoch")  # b has read it unbuilt
    a.saw(*lost)
    await settled(a)
    assert rebuilds(ma) == 2
    gate.set()
    await settled(b)
    assert rebuilds(mb) == 0  # (it took the free lease and rebuilt again before)
    epoch, built = await IndexEpoch(redis, prefix="sk").read()
    assert epoch == built == a.known == b.known


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


async def test_a_lost_index_learns_the_saves_only_a_node_holds(tmp_path: Path) -> None:
    """Saved while the store was away and not flushed yet: only the node's spill cache holds them."""
    redis, store = in_process_redis(), LocalStore(tmp_path / "store", prefix="sk")
    a, _ = healer(redis, store, [copy("s2", 2, 40), copy("s2", 3, 42), copy("s3", 1, 7)])
    await a.start(wait=True)
    index = SessionIndex(redis, prefix="sk")
    s2, s3 = await index.find("acme", "s2"), await index.find("acme", "s3")
    assert s2 is not None and (s2.state, s2.generation, s2.tokens) == (SessionState.SPILLED, 3, 42)
    assert s3 is not None and (s3.state, s3.generation, s3.tokens) == (SessionState.SPILLED, 1, 7)


async def test_while_the_store_is_away_too_a_turn_finds_its_session_on_a_node(tmp_path: Path) -> None:
    """The index lost while the store is down: the rebuild cannot list the store and is tried
    again, but a turn finds its session's save in a node's spill cache instead of starting anew."""
    redis, store = in_process_redis(), DownStore(tmp_path / "store", prefix="sk")
    a, metrics = healer(redis, store, [copy("s2", 2, 40)])
    epoch = IndexEpoch(redis, prefix="sk")
    await epoch.claim()  # another gateway built it once; then it was lost
    a.saw(*await epoch.read())
    assert a.healing
    found = await a.recover("acme", "s2")
    assert found is not None and (found.state, found.generation) == (SessionState.SPILLED, 2)
    assert await a.recover("acme", "nobody") is None  # a new session stays new
    assert a.healing and rebuilds(metrics) == 0  # the store's sessions are still to be rebuilt
    await a.close()


async def test_a_record_behind_its_save_catches_up_with_the_copy(tmp_path: Path) -> None:
    """A save finished but Redis was away when it would have recorded it, and the slot is gone:
    the record names no generation although one is stored. It catches up before the turn."""
    redis, store = in_process_redis(), LocalStore(tmp_path / "store", prefix="sk")
    on_nodes: list[UnstoredCopy] = []  # what the nodes' spill caches hold, as the test goes
    a, metrics = healer(redis, store, on_nodes)
    await a.start(wait=True)
    index = SessionIndex(redis, prefix="sk")
    await index.create("acme", "s1", model="m")
    first = await index.reserve_generation("acme", "s1")  # handed out, stored, never recorded
    src = tmp_path / "saved.slot"
    src.write_bytes(b"slot file" * 64)
    await store.put_file(SlotRef("acme", "s1", first), src, model="m", n_tokens=30)
    record = await index.find("acme", "s1")
    assert record is not None and record.state is SessionState.NEW and behind(record)
    caught = await a.catch_up(record)
    assert (caught.state, caught.generation, caught.tokens) == (SessionState.SPILLED, first, 30)
    assert not behind(caught) and await a.catch_up(caught) is caught
    assert metrics.index_recovered._value.get() == 1  # type: ignore[attr-defined]

    # Two more saves handed out, the second kept only on a node (the store away): that copy is newer.
    await index.reserve_generation("acme", "s1")
    on_nodes.append(copy("s1", await index.reserve_generation("acme", "s1"), 50))
    behind_again = await index.find("acme", "s1")
    assert behind_again is not None and behind(behind_again)
    newest = await a.catch_up(behind_again)
    assert (newest.generation, newest.tokens) == (3, 50)


async def test_a_record_not_behind_is_not_looked_up(tmp_path: Path) -> None:
    redis, store = in_process_redis(), DownStore(tmp_path / "store", prefix="sk")
    a, metrics = healer(redis, store)
    index = SessionIndex(redis, prefix="sk")
    record = await index.create("acme", "s1", model="m")
    assert not behind(record) and await a.catch_up(record) is record
    await index.reserve_generation("acme", "s1")  # a save that failed: nothing anywhere
    failed = await index.find("acme", "s1")
    assert failed is not None and behind(failed)
    assert await a.catch_up(failed) is failed  # the store away and no node copy: as it was
    assert not behind(replace(failed, state=SessionState.LIVE, engine="e", slot=0))  # its slot is newer
    assert metrics.index_recovered._value.get() == 0  # type: ignore[attr-defined]


class Primaries(IndexEpoch):
    """The epoch keys on the in-process Redis, with replication histories the test sets (a promoted
    replica shows one never seen; the in-process index has none of its own)."""

    now: frozenset[str] = frozenset({"first"})
    looks = 0

    async def histories(self) -> frozenset[str]:
        self.looks += 1
        return self.now


async def test_a_failover_before_the_first_watch_is_noticed(tmp_path: Path) -> None:
    redis, store = in_process_redis(), LocalStore(tmp_path / "store", prefix="sk")
    metrics, epoch = Metrics(), Primaries(redis, prefix="sk")
    a = IndexHealing(epoch, store, SessionIndex(redis, prefix="sk"), metrics, interval_s=0.01)
    await a.start(wait=True)
    assert rebuilds(metrics) == 1
    epoch.now = frozenset({"promoted"})  # the primary died and its replica took over at once
    watching = asyncio.create_task(a.watch())
    try:
        await until(lambda: rebuilds(metrics) == 2, "rebuilt after the failover")
        await settled(a)
        looked = epoch.looks
        await until(lambda: epoch.looks >= looked + 5, "five watches more")
        assert rebuilds(metrics) == 2  # one failover, one rebuild
    finally:
        watching.cancel()
        await a.close()

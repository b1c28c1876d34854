"""Collection of chunked sessions under concurrency: deletes racing each other and the collector,
unsure manifest writes, collector claims that must hold (or stop deleting) during long runs, and a
property test with writers, deleters and a collector at once. Fixtures: tests/storage/conftest.py."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from support.chunks import (
    PREFIX,
    REDIS_PREFIX,
    Faulty,
    Slots,
    assert_counter_exact,
    files_under,
    kv_names,
    make_ledger,
    named_by_manifests,
    pieces_and_tails,
    put,
    restores,
    within,
)

from storage.blobs.localstore import LocalStore
from storage.blobs.s3client import make_s3_client
from storage.blobs.s3store import S3Store
from storage.chunks.chunkstore import _HOLD_EVERY, ChunkedStore
from storage.chunks.ledger import ChunkLedger, LedgerKeys
from storage.errors import (
    LockBusy,
    LockLost,
    StoreUnavailable,
)
from storage.ids import SlotRef
from storage.index.keyspace import Keyspace


async def _shared_twice(store: ChunkedStore, slots: Slots) -> tuple[SlotRef, SlotRef]:
    """The same file saved as two sessions (every piece named twice), counts made exact."""
    a, b = SlotRef("acme", "a", 1), SlotRef("acme", "b", 1)
    await put(store, a, slots.grow[3])
    await put(store, b, slots.grow[3])
    await store.collect("acme")
    return a, b


async def test_deleting_one_generation_twice_at_once_keeps_other_sessions_pieces(
    store: ChunkedStore, inner: Faulty, slots: Slots, tmp_path: Path
) -> None:
    a, b = await _shared_twice(store, slots)
    both_read = asyncio.Barrier(2)

    async def read_together(key: str) -> None:
        if key.endswith(".manifest"):
            await within(both_read.wait(), "the second delete")

    inner.hooks["get_object"] = read_together
    await asyncio.gather(store.delete(a), store.delete(a))  # e.g. retention and an admin delete
    del inner.hooks["get_object"]
    await store.collect_unnamed("acme")
    await restores(store, b, slots.grow[3], tmp_path / "b.slot")


async def test_a_delete_racing_a_full_collection_keeps_other_sessions_pieces(
    store: ChunkedStore, inner: Faulty, slots: Slots, tmp_path: Path
) -> None:
    a, b = await _shared_twice(store, slots)

    async def collect_meanwhile(key: str) -> None:
        if key.endswith(".tail") and "delete_object" in inner.hooks:
            del inner.hooks["delete_object"]
            await store.collect("acme")  # the manifest of a is gone, its unname not yet done

    inner.hooks["delete_object"] = collect_meanwhile
    await store.delete(a)
    await store.collect_unnamed("acme")
    await restores(store, b, slots.grow[3], tmp_path / "b.slot")


class LateFailure(Faulty):
    """The manifest write reaches the store, then the call fails (a timeout after the server
    committed it): the outcome is unknown to the writer, the object is there."""

    fail_after_manifest = False

    async def put_object(self, key: str, data: bytes) -> None:
        await super().put_object(key, data)
        if self.fail_after_manifest and key.endswith(".manifest"):
            raise StoreUnavailable("injected: the response to a committed write was lost")


async def test_a_manifest_write_with_an_unknown_outcome_keeps_its_pieces(
    redis_client: Any, slots: Slots, tmp_path: Path
) -> None:
    inner = LateFailure(tmp_path / "store")
    store = ChunkedStore(inner, make_ledger(redis_client))
    a, b = SlotRef("acme", "a", 1), SlotRef("acme", "b", 1)
    await put(store, a, slots.grow[3])
    await store.collect("acme")  # counts exact
    inner.fail_after_manifest = True
    with pytest.raises(StoreUnavailable):
        await put(store, b, slots.grow[3])
    inner.fail_after_manifest = False
    assert b in [i.ref async for i in store.list("acme")]  # it is stored (reindex would adopt it)
    await store.delete(a)
    await store.collect_unnamed("acme")
    await restores(store, b, slots.grow[3], tmp_path / "b.slot")


def _collector_key(tenant: str = "acme") -> str:
    return LedgerKeys(Keyspace(REDIS_PREFIX)).collector(tenant)


async def _garbage(inner: Faulty, n: int, tenant: str = "acme") -> list[str]:
    """``n`` pieces no manifest names, sorted before every real piece (namespace 00…0)."""
    keys = [f"{PREFIX}/{tenant}/.chunks/{'0' * 32}/{i:064x}-00000000.kv" for i in range(n)]
    for key in keys:
        await inner.put_object(key, b"x")
    return keys


def _claim_ages(redis_client: Any, deletes: list[bool], step_ms: int) -> Callable[[str], Awaitable[None]]:
    """A delete_object hook: each delete uses up ``step_ms`` of the collector's claim (its PX is
    lowered, as time passing would), after noting whether the claim was still held."""

    async def hook(key: str) -> None:
        ttl = int(await redis_client.pttl(_collector_key()))
        deletes.append(ttl > 0)
        if ttl > step_ms:
            await redis_client.pexpire(_collector_key(), ttl - step_ms)
        elif ttl > 0:
            await redis_client.delete(_collector_key())

    return hook


async def test_a_long_collection_keeps_its_claim(
    redis_client: Any, inner: Faulty, slots: Slots, tmp_path: Path
) -> None:
    """Deleting is serial; with many pieces (or a slow store) it takes longer than collect_s: the
    collector renews its claim as it goes, so no save slips in meanwhile."""
    store = ChunkedStore(inner, make_ledger(redis_client, collect_s=30.0))
    src, kept = slots.grow[1], SlotRef("acme", "s1", 1)
    await put(store, kept, src)
    garbage = await _garbage(inner, 3 * _HOLD_EVERY + 10)
    deletes: list[bool] = []
    # each delete takes 0.4 s of the 30 s claim: 202 of them, 81 s in all; 64 take 25.6 s
    ages = _claim_ages(redis_client, deletes, 400)
    saver = make_ledger(redis_client, wait_s=0.0)

    async def a_save_comes(key: str) -> None:
        await ages(key)
        if len(deletes) == len(garbage) - 1:  # over a minute into the collection: still held
            with pytest.raises(LockBusy):
                async with saver.saving("acme"):
                    pytest.fail("a save ran beside the collector")

    inner.hooks["delete_object"] = a_save_comes
    report = await store.collect("acme")
    del inner.hooks["delete_object"]
    assert report.deleted == len(garbage) and all(deletes) and len(deletes) == len(garbage)
    assert not [k for k in garbage if (inner.root / k).exists()]
    await restores(store, kept, src, tmp_path / "kept.slot")
    await assert_counter_exact(store)
    await store.aclose()


async def test_a_long_count_based_collection_keeps_its_claim(
    redis_client: Any, inner: Faulty, slots: Slots
) -> None:
    store = ChunkedStore(inner, make_ledger(redis_client, collect_s=30.0))
    await store.collect("acme")  # counts exact
    garbage = await _garbage(inner, 3 * _HOLD_EVERY + 10)
    head = f"{PREFIX}/acme/.chunks/"
    named = {k.removeprefix(head): 1 for k in garbage}
    await store.ledger.name("acme", "m/1", named)
    await store.ledger.unname("acme", "m/1", named)  # all of them candidates now
    deletes: list[bool] = []
    inner.hooks["delete_object"] = _claim_ages(redis_client, deletes, 400)
    report = await store.collect_unnamed("acme")
    del inner.hooks["delete_object"]
    assert report.deleted == len(garbage) and all(deletes) and len(deletes) == len(garbage)
    assert not [k for k in garbage if (inner.root / k).exists()]
    await store.aclose()


@pytest.mark.parametrize("full", [True, False], ids=["collect", "collect_unnamed"])
async def test_a_collection_that_outlives_its_claim_stops_deleting(
    store: ChunkedStore, inner: Faulty, redis_client: Any, slots: Slots, tmp_path: Path, full: bool
) -> None:
    """The claim lapses inside a run of deletes (a delete that stalled past collect_s) and a save
    comes, finds pieces still there and names them: the collector notices at its next renewal
    (every _HOLD_EVERY deletes) and stops, before it reaches them. (A delete already under way
    when the claim lapses cannot be called back: that piece is not one the save may rely on here.)"""
    other = ChunkedStore(LocalStore(inner.root, prefix=PREFIX, fsync=False), make_ledger(redis_client))
    src, saved = slots.grow[3], SlotRef("acme", "s2", 1)
    await put(store, SlotRef("acme", "s1", 1), src)
    await store.collect("acme")  # counts exact
    if full:
        await store.delete(SlotRef("acme", "s1", 1))  # every piece of src is garbage now ...
    garbage = await _garbage(inner, _HOLD_EVERY + 20)  # ... listed after these
    if not full:  # candidates come in no set order: only these are, src stays named by s1
        head = f"{PREFIX}/acme/.chunks/"
        named = {k.removeprefix(head): 1 for k in garbage}
        await store.ledger.name("acme", "m/x", named)
        await store.ledger.unname("acme", "m/x", named)
    deletes = [0]

    async def claim_lapses_and_a_save_comes(key: str) -> None:
        deletes[0] += 1
        if deletes[0] == _HOLD_EVERY // 2:
            await redis_client.delete(_collector_key())
            await put(other, saved, src)  # finds src's pieces there and names them

    inner.hooks["delete_object"] = claim_lapses_and_a_save_comes
    with pytest.raises(LockLost):
        await (store.collect("acme") if full else store.collect_unnamed("acme"))
    del inner.hooks["delete_object"]
    assert deletes[0] == _HOLD_EVERY  # the rest of the run, not one more
    assert sum((inner.root / k).exists() for k in garbage) == len(garbage) - _HOLD_EVERY
    await restores(other, saved, src, tmp_path / "s2.slot")
    # the next collection finishes the job and keeps what the save named
    await store.collect("acme")
    assert not [k for k in garbage if (inner.root / k).exists()]
    assert pieces_and_tails(inner.root, "acme") == named_by_manifests(inner.root, "acme")
    await restores(other, saved, src, tmp_path / "s2b.slot")
    await assert_counter_exact(store)
    await other.aclose()


# ---------------------------------------------------------------------------------------------- S3
async def test_over_s3(
    s3_endpoint: str, key_prefix: str, redis_client: Any, slots: Slots, tmp_path: Path
) -> None:
    client = make_s3_client(endpoint_url=s3_endpoint, access_key="test", secret_key="test")
    ledger = ChunkLedger(redis_client, prefix=key_prefix, lease_s=60, collect_s=30, wait_s=20)
    store = ChunkedStore(S3Store(client, "slots", prefix=key_prefix), ledger)
    try:
        refs = [(SlotRef("acme", "s1", g), p) for g, p in enumerate(slots.grow[2:], start=1)]
        refs.append((SlotRef("acme", "f1", 1), slots.fork[0]))
        metas = [await put(store, ref, src) for ref, src in refs]
        assert all(m.written < m.size for m in metas[1:])
        for ref, src in refs:
            await restores(store, ref, src, tmp_path / f"{ref.session}{ref.generation}.slot")
        assert [i.ref async for i in store.list("acme")] == sorted(r for r, _ in refs)
        await store.delete(refs[0][0])  # an older turn: its tail goes, its pieces stay named
        await store.delete(refs[-1][0])  # the fork: its own pieces are garbage now
        report = await store.collect("acme")
        assert report.deleted > 0 and report.manifests == len(refs) - 2
        for ref, src in refs[1:-1]:
            await restores(store, ref, src, tmp_path / f"{ref.session}{ref.generation}b.slot")
        assert (await store.collect("acme")).deleted == 0
        stored = await store.stored_bytes("acme")
        assert int(await redis_client.get(Keyspace(key_prefix).stored_bytes("acme"))) == stored
        keys = [o.key async for o in store.list_objects(f"{key_prefix}/acme/")]
        assert (
            sum(k.endswith(".manifest") for k in keys)
            == sum(k.endswith(".tail") for k in keys)
            == len(refs) - 2
        )
        # the KV pieces of the two turns left: shared whole cells, and each one's own pieces
        assert sum(k.endswith(".kv") for k in keys) == len(kv_names(slots.grow[3], slots.grow[4]))
    finally:
        await store.aclose()
        client.close()


# ------------------------------------------------------------------------------------- GC property
@pytest.mark.parametrize("seed", [1, 2])
async def test_collection_never_takes_a_named_piece(
    redis_client: Any, inner: Faulty, slots: Slots, tmp_path: Path, seed: int
) -> None:
    """Writers save growing sessions (some sharing a prefix, one of them also as a fork) and delete
    all but their last two generations, deleters save and drop whole sessions, a collector runs
    full and count-based collections in a loop. Whatever interleaving: every committed manifest's
    pieces are there while it exists, and at the end nothing unnamed is left."""

    async def quick(seconds: float) -> None:
        await asyncio.sleep(seconds / 10)  # retry pacing only: a 10 ms backoff step is 1 ms here

    store = ChunkedStore(inner, make_ledger(redis_client, sleep=quick, wait_s=30.0))
    rng = random.Random(seed)

    async def latency(key: str) -> None:  # a store with latency: more interleavings
        await asyncio.sleep(rng.random() * 0.002)

    for op in ("put_object", "get_object", "delete_object"):
        inner.hooks[op] = latency
    sources: dict[SlotRef, Path] = {}
    stop = asyncio.Event()
    checked = [0]
    outdir = tmp_path / "out"
    outdir.mkdir()

    async def commit(ref: SlotRef, src: Path, **kw: Any) -> None:
        await put(store, ref, src, **kw)
        sources[ref] = src
        # committed: everything its manifest names is there, and it restores (nobody else deletes it)
        doc = json.loads(await inner.get_object(store.key_for(ref)))
        folder = f"{PREFIX}/{ref.tenant}/.chunks/{doc['ns'][:32]}"
        plan = doc["plan"]
        named = [f"{folder}/{name}.kv" for name, _ in plan["chunks"]]
        named += [f"{folder}/{entry[1]}.ck" for entry in plan["checkpoints"]]
        for key in named:
            assert await inner.object_exists(key), (ref, key)
        await restores(store, ref, src, outdir / f"{ref.tenant}.{ref.session}.{ref.generation}.slot")
        checked[0] += 1

    async def writer(i: int) -> None:
        tenant = "acme" if i % 3 else "globex"
        plans = [(f"w{i}", slots.grow), (f"w{i}f", slots.grow[:2] + slots.fork)]
        for session, files in plans:
            for gen, src in enumerate(files, start=1):
                ref = SlotRef(tenant, session, gen)
                await commit(ref, src, share=bool(rng.random() < 0.85))
                if gen > 2:
                    old = SlotRef(tenant, session, gen - 2)
                    await store.delete(old)
                    sources.pop(old)
                await asyncio.sleep(0)

    async def deleter(i: int) -> None:
        for round_ in range(3):
            session = f"d{i}r{round_}"
            for gen, src in enumerate(rng.sample(slots.grow, 2), start=1):
                await commit(SlotRef("acme", session, gen), src)
            async for info in store.list("acme", session):
                await store.delete(info.ref)
                sources.pop(info.ref)

    collections, deleted = [0, 0], [0, 0]

    async def collector() -> None:
        while not stop.is_set():
            for tenant in ("acme", "globex"):
                if rng.random() < 0.5:
                    deleted[0] += (await store.collect(tenant)).deleted
                    collections[0] += 1
                else:
                    deleted[1] += (await store.collect_unnamed(tenant)).deleted
                    collections[1] += 1
            await asyncio.sleep(0.005)  # pacing: leave the writers room between collections

    gc = asyncio.create_task(collector())
    try:
        await within(
            asyncio.gather(*(writer(i) for i in range(4)), *(deleter(i) for i in range(2))),
            "writers and deleters",
            120,
        )
    finally:
        stop.set()
        await within(gc, "the collector")
    assert checked[0] == len(slots.grow) * 4 + (2 + len(slots.fork)) * 4 + 2 * 3 * 2
    assert min(collections) > 0 and sum(deleted) > 0, (collections, deleted)
    for tenant in ("acme", "globex"):
        await store.collect(tenant)
        await store.collect(tenant)
        assert pieces_and_tails(inner.root, tenant) == named_by_manifests(inner.root, tenant)
        await assert_counter_exact(store, tenant)
    assert {i.ref for t in ("acme", "globex") async for i in store.list(t)} == set(sources)
    for ref, src in sources.items():
        await restores(store, ref, src, outdir / "final.slot")
    assert not [p for p in inner.root.rglob("*.part")]


async def test_lock_busy_is_what_a_save_sees_behind_a_stuck_collector(
    redis_client: Any, inner: Faulty, slots: Slots
) -> None:
    t = [1_700_000_000.0]

    async def fake_sleep(seconds: float) -> None:
        t[0] += seconds
        await asyncio.sleep(0)

    store = ChunkedStore(inner, make_ledger(redis_client, clock=lambda: t[0], sleep=fake_sleep, wait_s=5.0))
    async with store.ledger.collecting("acme"):
        with pytest.raises(LockBusy):
            await put(store, SlotRef("acme", "s1", 1), slots.grow[0])
        with pytest.raises(LockBusy):
            await store.collect("acme")  # a second collector
    assert files_under(inner.root, ".kv", ".ck", ".tail", ".manifest") == set()

"""storage.chunks.chunkstore.ChunkedStore over a LocalStore (and once over S3), with its ledger on a real
redis-server and on the in-process default, fed slot files written by the real native engine.

What is asserted is what a caller sees: the bytes a restore gives back, what a save wrote, which
objects the store holds, the tenant's stored-bytes counter, and that a collection never takes a
piece a committed manifest names — also with writers, deleters and a collector running at once.
Which KV pieces a file has (the whole 256-token cells, then pieces cut at the checkpoints inside its
last partial cell) is computed with storage.chunks.chunking.split, whose own tests pin that down."""

from __future__ import annotations

import asyncio
import json
import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from support.chunks import (
    PREFIX,
    Faulty,
    Slots,
    assert_counter_exact,
    assert_intact,
    counter,
    files_under,
    kv_names,
    kv_on_disk,
    make_ledger,
    n_tokens,
    named_by_manifests,
    pieces_and_tails,
    put,
    restores,
    split_of,
    within,
)

from storage.blobs.localstore import LocalStore
from storage.chunks.chunking import CHUNK_TOKENS
from storage.chunks.chunkstore import ChunkedStore
from storage.chunks.codec import MAGIC
from storage.errors import (
    ChecksumError,
    LockLost,
    NotStored,
    SlotFileError,
    StoreUnavailable,
    WriteConflict,
)
from storage.ids import SlotRef
from storage.slotfile.reader import read_slot_file, whole_file_crc32


# --------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("which", ["grow0", "grow4", "fork1", "rec1"])
async def test_put_get_round_trip(
    store: ChunkedStore, inner: Faulty, slots: Slots, tmp_path: Path, which: str
) -> None:
    src = {
        "grow0": slots.grow[0],
        "grow4": slots.grow[4],
        "fork1": slots.fork[1],
        "rec1": slots.recurrent[1],
    }[which]
    data = src.read_bytes()
    ref = SlotRef("acme", "s1", 1)
    meta = await put(store, ref, src, route="ab" * 8)
    assert (meta.size, meta.crc32, meta.n_tokens) == (len(data), zlib.crc32(data), n_tokens(src))
    assert meta.written == await store.stored_bytes("acme") > 0  # the first save wrote everything it holds
    await restores(store, ref, src, tmp_path / "back.slot")
    head = await store.head(ref)
    assert (head.key, head.size, head.crc32, head.n_tokens, head.route) == (
        meta.key,
        len(data),
        meta.crc32,
        meta.n_tokens,
        "ab" * 8,
    )
    assert head.model == read_slot_file(src).fingerprint
    assert [(i.ref, i.key) for i in [i async for i in store.list("acme")]] == [(ref, meta.key)]
    assert meta.key == f"{PREFIX}/acme/s1/{1:020d}.manifest"
    keys = files_under(inner.root, ".kv", ".ck", ".tail", ".manifest")
    assert f"{PREFIX}/acme/s1/{1:020d}.tail" in keys
    s = split_of(src)
    assert kv_on_disk(inner.root) == {p.name for p in s.chunks}  # every KV piece, once
    if which == "rec1":
        assert s.chunks == ()
    else:  # the whole cells, and at least one piece cut at a checkpoint in the last partial cell
        assert len(s.chunks) == len(s.bounds) - 1 > n_tokens(src) // CHUNK_TOKENS
    assert all(k.startswith(f"{PREFIX}/acme/.chunks/") for k in keys if k.endswith((".kv", ".ck")))
    with pytest.raises(WriteConflict):
        await put(store, ref, src)
    await assert_counter_exact(store)


async def test_checkpoints_and_tails_are_stored_compressed(
    redis_client: Any, inner: Faulty, slots: Slots, tmp_path: Path
) -> None:
    """The recurrent states (f32) are stored as compressed byte planes, the KV as it is; what a
    save wrote, the stored-bytes counter and the restore all follow the stored bytes."""
    store = ChunkedStore(inner, make_ledger(redis_client), compress=True)
    src, ref = slots.grow[4], SlotRef("acme", "s1", 1)
    meta = await put(store, ref, src)
    s = split_of(src)
    raw = {p.name: p.data for _, p in s.checkpoints} | {p.name: p.data for p in s.chunks}
    on_disk = {p.name.rsplit(".", 1)[0]: p.read_bytes() for p in (inner.root / PREFIX).rglob("*.c[k]")}
    assert set(on_disk) == {p.name for _, p in s.checkpoints} and on_disk
    for name, stored in on_disk.items():
        assert stored[:4] == MAGIC and len(stored) < 0.95 * len(raw[name]), name
    for p in (inner.root / PREFIX).rglob("*.kv"):
        assert p.read_bytes() == raw[p.name.removesuffix(".kv")]
    tail = (inner.root / PREFIX / "acme" / "s1" / f"{1:020d}.tail").read_bytes()
    assert tail[:4] == MAGIC and len(tail) < len(s.tail.data)
    assert meta.written == await store.stored_bytes("acme") < len(src.read_bytes())
    await restores(store, ref, src, tmp_path / "back.slot")
    await store.delete(ref)
    await store.collect_unnamed("acme")  # the counts' sizes are the stored ones: back to zero exactly
    await assert_counter_exact(store)
    assert await store.stored_bytes("acme") == 0


async def test_writers_that_store_states_raw_and_compressed_share_pieces(
    redis_client: Any, inner: Faulty, slots: Slots, tmp_path: Path
) -> None:
    """A node that compresses and one that does not (a setting changed, nodes of two versions):
    each reads what the other wrote, a piece stored one way is not stored again the other, and the
    counter follows what is on disk through saves, deletes and count-based collection."""
    raw = ChunkedStore(inner, make_ledger(redis_client))
    packed = ChunkedStore(inner, make_ledger(redis_client), compress=True)
    saves = [
        (raw, SlotRef("acme", "s1", 1), slots.grow[2]),
        (packed, SlotRef("acme", "s1", 2), slots.grow[3]),
        (raw, SlotRef("acme", "s1", 3), slots.grow[4]),
        (packed, SlotRef("acme", "s2", 1), slots.grow[3]),
    ]
    written = []
    for writer, ref, src in saves:
        written.append((await put(writer, ref, src)).written)
        await assert_counter_exact(writer)
    own = sum(p.stat().st_size for p in (inner.root / PREFIX / "acme" / "s2").iterdir())
    assert written[3] == own  # the same file again: only its tail and manifest
    for reader in (raw, packed):
        for _, ref, src in saves:
            await restores(reader, ref, src, tmp_path / "back.slot")
    for writer, ref, _ in saves[:3]:
        await (packed if writer is raw else raw).delete(ref)
        await packed.collect_unnamed("acme")
        await assert_counter_exact(packed)
    await restores(raw, saves[3][1], saves[3][2], tmp_path / "back.slot")
    assert (await raw.collect("acme")).deleted == 0  # the counts took exactly the unnamed


async def test_a_wrong_crc_writes_nothing(store: ChunkedStore, inner: Faulty, slots: Slots) -> None:
    src = slots.grow[2]
    with pytest.raises(ChecksumError):
        await store.put_file(
            SlotRef("acme", "s1", 1), src, model="m", n_tokens=1, crc32=whole_file_crc32(src) ^ 1
        )
    assert files_under(inner.root, "") == set()  # no object at all
    assert await counter(store) == 0


async def test_absent_generations(store: ChunkedStore, tmp_path: Path) -> None:
    ref = SlotRef("acme", "nobody", 1)
    with pytest.raises(NotStored):
        await store.head(ref)
    with pytest.raises(NotStored):
        await store.get_to_file(ref, tmp_path / "x.slot")
    assert not (tmp_path / "x.slot").exists()
    assert [i async for i in store.list("acme")] == []
    await store.delete(ref)  # absent: not an error
    assert (await store.collect("acme")).deleted == 0


async def test_two_saves_of_one_generation_at_once_one_conflicts(
    store: ChunkedStore, inner: Faulty, slots: Slots, tmp_path: Path
) -> None:
    """BlobStore.put_file's contract: WriteConflict if the generation exists — also for two writers at
    once (LocalStore claims with os.link, S3 with a conditional write). The first save is held at
    its existence check until the other has either reached its own or finished."""
    ref = SlotRef("acme", "s1", 1)
    arrived, go_on = [0], asyncio.Event()

    async def check_together(key: str) -> None:
        if key == store.key_for(ref):
            arrived[0] += 1
            if arrived[0] == 2:
                go_on.set()
            await within(go_on.wait(), "the other save")

    inner.hooks["object_size"] = check_together
    sources = (slots.grow[1], slots.grow[2])
    tasks = [asyncio.create_task(put(store, ref, src)) for src in sources]
    for task in tasks:
        task.add_done_callback(lambda _: go_on.set())
    results = await asyncio.gather(*tasks, return_exceptions=True)
    del inner.hooks["object_size"]
    won = [src for src, r in zip(sources, results, strict=True) if not isinstance(r, BaseException)]
    assert [type(r) for r in results if isinstance(r, BaseException)] == [WriteConflict]
    await restores(store, ref, won[0], tmp_path / "won.slot")
    # the claim went with the winner: the generation is now taken by its manifest, the next is free
    assert not await store.ledger._redis.keys("*:chunks:writing:*")
    with pytest.raises(WriteConflict):
        await put(store, ref, won[0])
    await put(store, SlotRef("acme", "s1", 2), slots.grow[3])
    await store.collect("acme")
    await assert_counter_exact(store)


async def test_a_save_waiting_for_a_collector_keeps_its_generation(
    redis_client: Any, inner: Faulty, slots: Slots, eventually: Callable[..., Awaitable[None]]
) -> None:
    """A save that claimed its generation, then waited for a collector longer than its lease lasts,
    still commits (its lease starts when the collector is gone): a second save of the same
    generation started meanwhile must get WriteConflict."""
    store = ChunkedStore(inner, make_ledger(redis_client, lease_s=2.0))
    ref = SlotRef("acme", "s1", 1)
    checked = [0]

    async def count(key: str) -> None:
        if key == store.key_for(ref):
            checked[0] += 1

    async def a_waits() -> bool:
        return checked[0] == 1

    inner.hooks["object_size"] = count
    tasks: list[asyncio.Task[Any]] = []
    try:
        async with store.ledger.collecting("acme"):  # saves wait for it (up to wait_s, 20 s)
            tasks.append(asyncio.create_task(put(store, ref, slots.grow[1])))
            await eventually(a_waits, "the first save waiting for the collector")
            await asyncio.sleep(store.ledger.lease_s + 0.3)  # the scenario: it waits longer than lease_s
            tasks.append(asyncio.create_task(put(store, ref, slots.grow[3])))

            async def b_checked_or_done() -> bool:
                return checked[0] == 2 or tasks[1].done()

            await eventually(b_checked_or_done, "the second save refused or waiting", 10)
        results = await within(asyncio.gather(*tasks, return_exceptions=True), "both saves")
    finally:
        for task in tasks:
            task.cancel()
        await store.aclose()
    assert [type(r) for r in results if isinstance(r, BaseException)] == [WriteConflict]
    assert not isinstance(results[0], BaseException)  # the first one keeps its generation


# ------------------------------------------------------------------------------------------- sharing
async def test_a_grown_session_writes_only_what_is_new(
    store: ChunkedStore, inner: Faulty, slots: Slots, tmp_path: Path
) -> None:
    first = await put(store, SlotRef("acme", "s1", 1), slots.grow[-1])
    chunks_before = files_under(inner.root, ".kv")
    meta = await put(store, SlotRef("acme", "s1", 2), slots.grow_more)
    assert meta.size == slots.grow_more.stat().st_size
    assert meta.written < 0.5 * meta.size, (meta.written, meta.size)
    # a few more tokens, in the same cell: every piece of the last turn is kept (its checkpoints
    # too), and the only new KV is cut after its last one
    before, after = split_of(slots.grow[-1]), split_of(slots.grow_more)
    new = kv_on_disk(inner.root) - {Path(k).name.removesuffix(".kv") for k in chunks_before}
    assert new == kv_names(slots.grow_more) - kv_names(slots.grow[-1]) and new
    assert kv_names(slots.grow[-1]) <= kv_names(slots.grow_more)
    starts = {p.name: a for a, p in zip(after.bounds[:-1], after.chunks, strict=True)}
    assert all(starts[name] >= before.tail_start for name in new)
    assert sum(len(p.data) for p in after.chunks if p.name in new) < 0.05 * meta.size
    assert first.written + meta.written == await store.stored_bytes("acme")
    saved = {SlotRef("acme", "s1", 1): slots.grow[-1], SlotRef("acme", "s1", 2): slots.grow_more}
    await assert_intact(store, saved, tmp_path)


async def test_every_turn_writes_less_than_its_file(
    store: ChunkedStore, inner: Faulty, slots: Slots, tmp_path: Path
) -> None:
    total = 0
    for gen, src in enumerate(slots.grow, start=1):
        meta = await put(store, SlotRef("acme", "s1", gen), src)
        total += meta.written
        if gen > 1:
            assert meta.written < meta.size
        # each piece stored once: the union of the turns' pieces (the whole cells they share, and
        # those cut at checkpoints in each turn's last partial cell)
        assert kv_on_disk(inner.root) == kv_names(*slots.grow[:gen])
    assert total == await store.stored_bytes("acme") < sum(p.stat().st_size for p in slots.grow) // 2
    for gen, src in enumerate(slots.grow, start=1):
        await restores(store, SlotRef("acme", "s1", gen), src, tmp_path / f"{gen}.slot")


async def test_a_fork_writes_only_its_tail_and_manifest(
    store: ChunkedStore, inner: Faulty, slots: Slots, tmp_path: Path
) -> None:
    src = slots.grow[3]
    await put(store, SlotRef("acme", "s1", 1), src)
    pieces = files_under(inner.root, ".kv", ".ck")
    before = await store.stored_bytes("acme")
    fork = await put(store, SlotRef("acme", "s2", 1), src, share=True)
    assert files_under(inner.root, ".kv", ".ck") == pieces
    own = [inner.root / PREFIX / "acme" / "s2" / f"{1:020d}.{x}" for x in ("tail", "manifest")]
    assert fork.written == sum(p.stat().st_size for p in own) == await store.stored_bytes("acme") - before
    private = await put(store, SlotRef("acme", "s3", 1), src, share=False)
    new = files_under(inner.root, ".kv", ".ck") - pieces
    assert len(new) == len(pieces) and private.written > 0.8 * private.size
    assert {k.split("/")[3] for k in new}.isdisjoint({k.split("/")[3] for k in pieces})  # another namespace
    for session in ("s1", "s2", "s3"):
        await restores(store, SlotRef("acme", session, 1), src, tmp_path / f"{session}.slot")
    await assert_counter_exact(store)


async def test_a_fork_with_another_ending_shares_the_common_chunks(
    store: ChunkedStore, inner: Faulty, slots: Slots
) -> None:
    await put(store, SlotRef("acme", "s1", 1), slots.grow[-1])
    pieces = kv_on_disk(inner.root)
    meta = await put(store, SlotRef("acme", "f1", 1), slots.fork[0])
    new = kv_on_disk(inner.root) - pieces
    fork = split_of(slots.fork[0])
    assert fork.chunks[0].name in pieces  # the first 256 tokens' piece was there
    assert new == kv_names(slots.fork[0]) - pieces and len(new) < len(fork.chunks)
    assert meta.written < meta.size


async def test_a_fork_at_a_checkpoint_writes_no_kv_up_to_it(
    store: ChunkedStore, inner: Faulty, slots: Slots, tmp_path: Path
) -> None:
    """The branch diverges at the parent's last checkpoint, inside the parent's last partial cell:
    the piece ending there is the parent's (one object, by name), so the branch's save writes KV
    only for the tokens after it."""
    parent = await put(store, SlotRef("acme", "s1", 1), slots.grow[-1])
    pieces = kv_on_disk(inner.root)
    meta = await put(store, SlotRef("acme", "b1", 1), slots.branch)
    ps, bs = split_of(slots.grow[-1]), split_of(slots.branch)
    cut = ps.tail_start
    i = bs.bounds.index(cut)
    assert bs.chunks[i - 1].name == ps.chunks[-1].name and bs.bounds[i - 1] == ps.bounds[-2]
    assert {p.name for p in bs.chunks[:i]} <= pieces
    new = kv_on_disk(inner.root) - pieces
    assert new == {p.name for p in bs.chunks[i:]}  # begins at cut or later
    own_kv = sum(len(p.data) for p in bs.chunks[i:])
    assert 0 < meta.written < own_kv + 0.2 * meta.size < parent.written
    saved = {SlotRef("acme", "s1", 1): slots.grow[-1], SlotRef("acme", "b1", 1): slots.branch}
    await assert_intact(store, saved, tmp_path)


async def test_tenants_never_share_pieces(
    store: ChunkedStore, inner: Faulty, slots: Slots, tmp_path: Path
) -> None:
    src = slots.grow[3]
    a = await put(store, SlotRef("acme", "s1", 1), src)
    b = await put(store, SlotRef("globex", "s1", 1), src)
    acme = files_under(inner.root / PREFIX / "acme" / ".chunks", ".kv", ".ck")
    globex = files_under(inner.root / PREFIX / "globex" / ".chunks", ".kv", ".ck")
    assert len(acme) == len(globex) > 0 and acme.isdisjoint(globex)  # other names, each in its own folder
    assert abs(a.written - b.written) < 100  # the second tenant wrote everything again
    await store.delete(SlotRef("acme", "s1", 1))
    await store.collect("acme")
    assert files_under(inner.root / PREFIX / "acme", ".kv", ".ck", ".tail") == set()
    await restores(store, SlotRef("globex", "s1", 1), src, tmp_path / "g.slot")
    await assert_counter_exact(store, "acme")
    await assert_counter_exact(store, "globex")


# ------------------------------------------------------------------------------ deletes and collection
async def test_stored_bytes_follow_puts_deletes_and_collections(
    store: ChunkedStore, inner: Faulty, slots: Slots, tmp_path: Path
) -> None:
    refs = [(SlotRef("acme", "s1", g), p) for g, p in enumerate(slots.grow[:3], start=1)]
    refs += [(SlotRef("acme", "f1", g), p) for g, p in enumerate(slots.fork, start=1)]
    for ref, src in refs:
        await put(store, ref, src)
        await assert_counter_exact(store)
    await store.delete(refs[0][0])  # an older turn: its pieces are named by the newer ones ...
    await assert_counter_exact(store)
    # ... but for those cut at checkpoints in its last partial cell, which the next turn filled
    # (that cell is a whole piece there): only they are left unnamed
    garbage = pieces_and_tails(inner.root, "acme") - named_by_manifests(inner.root, "acme")
    first = split_of(refs[0][1])
    last_cell = {p.name for a, p in zip(first.bounds[:-1], first.chunks, strict=True) if a >= CHUNK_TOKENS}
    assert {Path(k).name.removesuffix(".kv") for k in garbage} == last_cell - kv_names(*slots.grow[1:3])
    assert last_cell and all(k.endswith(".kv") for k in garbage)
    report = await store.collect("acme")
    assert report.deleted == len(garbage) and report.stored_bytes == await store.stored_bytes("acme")
    assert report.manifests == len(refs) - 1
    await assert_counter_exact(store)
    for ref, _ in refs[3:]:  # the whole fork: its own pieces are named by nothing now
        await store.delete(ref)
        await assert_counter_exact(store)
    unnamed = await store.collect_unnamed("acme")
    assert unnamed.deleted > 0  # without a listing
    await assert_counter_exact(store)
    assert pieces_and_tails(inner.root, "acme") == named_by_manifests(inner.root, "acme")
    assert (await store.collect("acme")).deleted == 0  # nothing left for the full collection
    for ref, src in refs[1:3]:
        await restores(store, ref, src, tmp_path / f"{ref.session}{ref.generation}.slot")
    await assert_counter_exact(store)


async def test_collect_takes_exactly_the_unnamed(
    store: ChunkedStore, inner: Faulty, slots: Slots, tmp_path: Path
) -> None:
    refs = [(SlotRef("acme", "s1", g), p) for g, p in enumerate(slots.grow, start=1)]
    refs += [(SlotRef("acme", "f1", g), p) for g, p in enumerate(slots.fork, start=1)]
    for ref, src in refs:
        await put(store, ref, src)
    epoch = await store.ledger.epoch("acme")
    gone = refs[:3] + refs[-2:]  # older turns, and the whole fork
    for ref, _ in gone:
        await store.delete(ref)
    named = named_by_manifests(inner.root, "acme")
    garbage = pieces_and_tails(inner.root, "acme") - named
    assert garbage
    report = await store.collect("acme")
    assert pieces_and_tails(inner.root, "acme") == named
    assert report.deleted == len(garbage) and report.manifests == len(refs) - len(gone)
    assert await store.ledger.epoch("acme") == epoch + 1
    for ref, src in refs[3:-2]:
        await restores(store, ref, src, tmp_path / f"{ref.session}{ref.generation}.slot")
    # the store forgot what it knew of the collected pieces: saving the deleted files again restores
    for ref, src in gone:
        again = SlotRef(ref.tenant, ref.session, ref.generation + 100)
        await put(store, again, src)
        await restores(store, again, src, tmp_path / "again.slot")
    await assert_counter_exact(store)


async def test_another_process_collecting_makes_this_one_upload_again(
    store: ChunkedStore, inner: Faulty, redis_client: Any, slots: Slots, tmp_path: Path
) -> None:
    """Store A knows which pieces it saw (per epoch); store B collects them: A's next save must not
    trust what it knew and must upload them again."""
    other = ChunkedStore(LocalStore(inner.root, prefix=PREFIX, fsync=False), make_ledger(redis_client))
    src = slots.grow[3]
    await put(store, SlotRef("acme", "s1", 1), src)
    await store.delete(SlotRef("acme", "s1", 1))
    await other.collect("acme")
    assert files_under(inner.root, ".kv", ".ck") == set()
    meta = await put(store, SlotRef("acme", "s1", 2), src)
    assert meta.written > 0.8 * meta.size
    await restores(other, SlotRef("acme", "s1", 2), src, tmp_path / "b.slot")
    await other.aclose()


async def test_documents_and_other_sessions_survive_collection(
    store: ChunkedStore, inner: Faulty, slots: Slots
) -> None:
    await store.put_document("acme", "session", "s1", b'{"x": 1}')
    await put(store, SlotRef("acme", "s1", 1), slots.grow[0])
    await store.collect("acme")
    assert await store.get_document("acme", "session", "s1") == b'{"x": 1}'
    assert (await store.head(SlotRef("acme", "s1", 1))).size == slots.grow[0].stat().st_size


async def test_stored_bytes_and_documents(store: ChunkedStore, slots: Slots) -> None:
    await put(store, SlotRef("acme", "s1", 1), slots.grow[0])
    await store.collect("acme")
    await store.put_document("acme", "responses", "r1", b"x" * 1000)
    await assert_counter_exact(store)
    await store.collect("acme")
    await store.delete_document("acme", "responses", "r1")
    await assert_counter_exact(store)


# ---------------------------------------------------------------------------------- crash consistency
async def put_dying_before_its_manifest(store: ChunkedStore, inner: Faulty, ref: SlotRef, src: Path) -> None:
    """A save of `src` whose process dies at its manifest put: what comes before it is written."""

    async def die(key: str) -> None:
        if key.endswith(".manifest"):
            raise StoreUnavailable("injected: the process died before the manifest")

    inner.hooks["put_object"] = die
    with pytest.raises(StoreUnavailable):
        await put(store, ref, src)
    del inner.hooks["put_object"]


async def test_a_save_that_dies_before_its_manifest(
    redis_client: Any, inner: Faulty, slots: Slots, tmp_path: Path
) -> None:
    """The manifest put fails (the process died there): the previous generation stays restorable,
    the broken one is invisible, its lease lapses, and a collection removes what it left."""
    now = [1_700_000_000.0]
    store = ChunkedStore(inner, make_ledger(redis_client, clock=lambda: now[0]))
    good, bad = SlotRef("acme", "s1", 1), SlotRef("acme", "s1", 2)
    await put(store, good, slots.grow[1])
    before = pieces_and_tails(inner.root, "acme")
    await put_dying_before_its_manifest(store, inner, bad, slots.grow[3])
    orphans = pieces_and_tails(inner.root, "acme") - before
    assert any(k.endswith(".kv") for k in orphans) and f"{PREFIX}/acme/s1/{2:020d}.tail" in orphans
    assert [i.ref async for i in store.list("acme")] == [good]
    assert [i.ref async for i in store.list("acme", "s1")] == [good]
    with pytest.raises(NotStored):
        await store.head(bad)
    with pytest.raises(NotStored):
        await store.get_to_file(bad, tmp_path / "bad.slot")
    await restores(store, good, slots.grow[1], tmp_path / "good.slot")
    # a saver killed outright (no finally) leaves its lease: the collector waits for it to lapse
    dead = store.ledger.saving("acme")
    await dead.__aenter__()
    now[0] += store.ledger.lease_s + 1
    report = await within(store.collect("acme"), "collect past a dead saver")
    assert pieces_and_tails(inner.root, "acme") == before == named_by_manifests(inner.root, "acme")
    assert report.deleted == len(orphans)
    await assert_counter_exact(store)
    # the generation can be saved again, and its pieces are uploaded again
    meta = await put(store, bad, slots.grow[3])
    assert meta.written >= sum((inner.root / k).stat().st_size for k in orphans if k.endswith(".kv")) > 0
    await restores(store, bad, slots.grow[3], tmp_path / "bad.slot")
    await assert_counter_exact(store)


async def test_a_save_retried_after_a_crash_before_collection(
    store: ChunkedStore, inner: Faulty, slots: Slots, tmp_path: Path
) -> None:
    ref = SlotRef("acme", "s1", 1)
    await put_dying_before_its_manifest(store, inner, ref, slots.grow[2])
    meta = await put(store, ref, slots.grow[2])  # not a WriteConflict: nothing was committed
    assert meta.written < 0.5 * meta.size  # the pieces were there already
    await restores(store, ref, slots.grow[2], tmp_path / "a.slot")
    await store.collect("acme")
    await assert_counter_exact(store)


async def test_a_lapsed_lease_refuses_to_commit(redis_client: Any, inner: Faulty, slots: Slots) -> None:
    """A save slower than its lease must not write its manifest (a collector may have run)."""
    now = [1_700_000_000.0]
    store = ChunkedStore(inner, make_ledger(redis_client, clock=lambda: now[0]))

    async def slow(key: str) -> None:
        if key.endswith(".tail"):
            now[0] += store.ledger.lease_s - 10  # less than the 30 s commit margin left

    inner.hooks["put_object"] = slow
    with pytest.raises(LockLost):
        await put(store, SlotRef("acme", "s1", 1), slots.grow[2])
    assert [i async for i in store.list("acme")] == []
    assert files_under(inner.root, ".manifest") == set()


@pytest.mark.parametrize("damage", ["not json", "stored sizes"])
async def test_a_damaged_manifest_keeps_every_piece_at_collection(
    store: ChunkedStore, inner: Faulty, slots: Slots, tmp_path: Path, damage: str
) -> None:
    await put(store, SlotRef("acme", "s1", 1), slots.grow[3])
    await put(store, SlotRef("acme", "s2", 1), slots.grow[1])
    await store.delete(SlotRef("acme", "s2", 1))
    manifest = inner.root / PREFIX / "acme" / "s1" / f"{1:020d}.manifest"
    if damage == "not json":
        manifest.write_bytes(b"{ damaged")
    else:
        doc = json.loads(manifest.read_bytes())
        doc["stored"] = {"x": "many"}
        manifest.write_text(json.dumps(doc))
    with pytest.raises(SlotFileError):
        await store.get_to_file(SlotRef("acme", "s1", 1), tmp_path / "back.slot")
    before = pieces_and_tails(inner.root, "acme")
    report = await store.collect("acme")
    assert report.deleted == 0 and pieces_and_tails(inner.root, "acme") == before
    assert (await store.collect_unnamed("acme")).deleted == 0  # counts are not trusted either


# --------------------------------------------------------------------------------------- legacy v1
async def test_a_v1_slot_file_stored_before_chunking(
    store: ChunkedStore, inner: Faulty, slots: Slots, tmp_path: Path
) -> None:
    old, new = SlotRef("acme", "s1", 1), SlotRef("acme", "s1", 2)
    legacy = await put(inner, old, slots.grow[1])
    await put(store, new, slots.grow[2])
    listed = [i async for i in store.list("acme", "s1")]
    assert [i.ref for i in listed] == [old, new]
    assert listed[0].key == legacy.key and listed[0].size == legacy.size
    assert (await store.head(old)).crc32 == legacy.crc32
    assert (await store.latest("acme", "s1")).ref == new  # type: ignore[union-attr]
    await restores(store, old, slots.grow[1], tmp_path / "old.slot")
    with pytest.raises(WriteConflict):
        await put(store, old, slots.grow[1])
    await store.collect("acme")
    await restores(store, old, slots.grow[1], tmp_path / "old2.slot")  # collection leaves v1 files alone
    await store.delete(old)
    assert [i.ref async for i in store.list("acme")] == [new]
    with pytest.raises(NotStored):
        await store.head(old)
    await restores(store, new, slots.grow[2], tmp_path / "new.slot")


async def test_stored_bytes_after_deleting_a_v1_file(
    store: ChunkedStore, inner: Faulty, slots: Slots
) -> None:
    old = SlotRef("acme", "s1", 1)
    await put(inner, old, slots.grow[1])
    await put(store, SlotRef("acme", "s1", 2), slots.grow[2])
    await store.collect("acme")
    await assert_counter_exact(store)
    await store.delete(old)
    await assert_counter_exact(store)


# ------------------------------------------------------------------ reference counts under concurrency

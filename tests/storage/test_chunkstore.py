"""storage.chunkstore.ChunkedStore over a LocalStore (and once over S3), with its ledger on a real
redis-server and on the in-process default, fed slot files written by the real native engine.

What is asserted is what a caller sees: the bytes a restore gives back, what a save wrote, which
objects the store holds, the tenant's stored-bytes counter, and that a collection never takes a
piece a committed manifest names — also with writers, deleters and a collector running at once.
Which KV pieces a file has (the whole 256-token cells, then pieces cut at the checkpoints inside its
last partial cell) is computed with storage.chunking.split, whose own tests pin that down."""

from __future__ import annotations

import asyncio
import json
import random
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

import native
from storage import chunkstore
from storage.blobstore import BlobStore
from storage.chunking import CHUNK_TOKENS, Split, split
from storage.chunkstore import _HOLD_EVERY, ChunkedStore
from storage.errors import (
    ChecksumError,
    Conflict,
    LockBusy,
    LockLost,
    NotFound,
    SlotFileError,
    StorageError,
    StoreUnavailable,
)
from storage.ids import SlotRef
from storage.keyspace import Keyspace
from storage.ledger import ChunkLedger, LedgerKeys
from storage.localstore import LocalStore
from storage.s3client import make_s3_client
from storage.s3store import S3Store
from storage.slotfile import read_slot_file, read_tokens, whole_file_crc32

T = TypeVar("T")
PREFIX = "slots"  # the blob store's key prefix
REDIS_PREFIX = "sk"


# ------------------------------------------------------------------------------------------ slot files
@dataclass(frozen=True)
class Slots:
    """Slot files of one qwen35 engine (slot 0 throughout, so KV bytes of one prefix agree):
    ``grow`` is one session saved after each turn (about 300, 520, ... 1180 tokens), ``grow_more``
    its last file plus a few tokens, ``fork`` the first 400 tokens of ``grow`` then another text,
    growing for two turns; ``branch`` is the last ``grow`` file restored into a fresh engine and
    continued with other text from its last checkpoint (inside its last partial cell);
    ``recurrent`` are two turns of a mamba2 session (no chunkable KV)."""

    grow: tuple[Path, ...]
    grow_more: Path
    fork: tuple[Path, ...]
    branch: Path
    recurrent: tuple[Path, ...]


def _turn(eng: Any, prompt: list[int], path: Path, slot: int = 0) -> Path:
    p = native.RequestParams(prompt)
    p.n_predict, p.temperature = 2, 0.0
    eng.generate(slot, p)
    eng.save_slot(slot, str(path))
    return path


@pytest.fixture(scope="module")
def slots(tiny_model: Callable[..., str], tmp_path_factory: pytest.TempPathFactory) -> Slots:
    root = tmp_path_factory.mktemp("chunkstore-slots")
    eng = native.Engine(
        native.EngineConfig(tiny_model("qwen35"), n_ctx=4096, n_slots=2, checkpoint_interval=64)
    )
    try:
        grow = [_turn(eng, eng.tokenize("some text " * 150), root / "grow0.slot")]
        for i in range(1, 5):
            grow.append(
                _turn(
                    eng,
                    eng.slot_tokens(0) + eng.tokenize(f" turn {i} " + "words " * 70),
                    root / f"grow{i}.slot",
                )
            )
        grow_more = _turn(eng, eng.slot_tokens(0) + eng.tokenize(" ok"), root / "grow_more.slot")
        head = read_tokens_of(grow[-1])[:400]
        fork = [_turn(eng, head + eng.tokenize(" other words" * 40), root / "fork0.slot")]
        fork.append(_turn(eng, eng.slot_tokens(0) + eng.tokenize(" and more" * 40), root / "fork1.slot"))
    finally:
        eng.close()
    # a fresh engine: the restored cells and the new ones lie in position order (chunkable)
    cut = split_of(grow[-1]).tail_start
    eng = native.Engine(
        native.EngineConfig(tiny_model("qwen35"), n_ctx=4096, n_slots=2, checkpoint_interval=64)
    )
    try:
        eng.restore_slot(1, str(grow[-1]))
        prompt = read_tokens_of(grow[-1])[:cut] + eng.tokenize(" other words" * 10)
        branch = _turn(eng, prompt, root / "branch.slot", slot=1)
    finally:
        eng.close()
    eng = native.Engine(
        native.EngineConfig(tiny_model("mamba2"), n_ctx=4096, n_slots=2, checkpoint_interval=64)
    )
    try:
        recurrent = [_turn(eng, eng.tokenize("some text " * 150), root / "rec0.slot")]
        recurrent.append(_turn(eng, eng.slot_tokens(0) + eng.tokenize(" more" * 50), root / "rec1.slot"))
    finally:
        eng.close()
    out = Slots(tuple(grow), grow_more, tuple(fork), branch, tuple(recurrent))
    sizes = [n_tokens(p) for p in out.grow]
    assert sizes == sorted(sizes) and sizes[0] < CHUNK_TOKENS + 100 and sizes[-1] > 3 * CHUNK_TOKENS
    assert n_tokens(out.grow_more) // CHUNK_TOKENS == sizes[-1] // CHUNK_TOKENS  # no new whole chunk
    # the last turn ends with a piece cut at a checkpoint in its last partial cell; the branch
    # diverges there, inside that cell, and keeps the checkpoint (a bound of its own pieces)
    last = split_of(grow[-1])
    assert cut > sizes[-1] // CHUNK_TOKENS * CHUNK_TOKENS and len(last.chunks) > sizes[-1] // CHUNK_TOKENS
    assert cut in split_of(branch).bounds and n_tokens(branch) // CHUNK_TOKENS == sizes[-1] // CHUNK_TOKENS
    return out


def split_of(path: Path, scope: str = "acme") -> Split:
    """The pieces a save of ``path`` stores (``scope``: the tenant's when shared)."""
    return split(path.read_bytes(), read_slot_file(path, checksum=False), scope=scope)


def kv_names(*paths: Path) -> set[str]:
    """Names of the KV pieces of the files, shared in tenant acme."""
    return {p.name for path in paths for p in split_of(path).chunks}


def kv_on_disk(root: Path) -> set[str]:
    """Names of the KV pieces in the store."""
    return {Path(k).name.removesuffix(".kv") for k in files_under(root, ".kv")}


def read_tokens_of(path: Path) -> list[int]:
    return read_tokens(read_slot_file(path))


def n_tokens(path: Path) -> int:
    return read_slot_file(path, checksum=False).n_tokens


# -------------------------------------------------------------------------------------------- stores
class Faulty(LocalStore):
    """A LocalStore whose raw-object calls can be intercepted: ``hooks[name](key)`` runs before
    the call and may raise (the write never happens) or do something in between."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, prefix=PREFIX, fsync=False)
        self.hooks: dict[str, Callable[[str], Awaitable[None]]] = {}

    async def _hook(self, name: str, key: str) -> None:
        hook = self.hooks.get(name)
        if hook is not None:
            await hook(key)

    async def put_object(self, key: str, data: bytes) -> None:
        await self._hook("put_object", key)
        await super().put_object(key, data)

    async def get_object(self, key: str) -> bytes:
        await self._hook("get_object", key)
        return await super().get_object(key)

    async def object_exists(self, key: str) -> bool:
        await self._hook("object_exists", key)
        return await super().object_exists(key)

    async def delete_object(self, key: str) -> None:
        await self._hook("delete_object", key)
        await super().delete_object(key)


def make_ledger(redis: Any, **kw: Any) -> ChunkLedger:
    # lease_s must stay above put_file's 30 s commit margin (SaveLease.check's default)
    opts: dict[str, Any] = {"lease_s": 60.0, "collect_s": 30.0, "wait_s": 20.0} | kw
    return ChunkLedger(redis, prefix=REDIS_PREFIX, **opts)


@pytest.fixture
def inner(tmp_path: Path) -> Faulty:
    return Faulty(tmp_path / "store")


@pytest.fixture
async def store(inner: Faulty, redis_client: Any) -> AsyncIterator[ChunkedStore]:
    s = ChunkedStore(inner, make_ledger(redis_client))
    yield s
    await s.aclose()


async def put(store: BlobStore, ref: SlotRef, path: Path, **kw: Any) -> Any:
    fingerprint = read_slot_file(path, checksum=False).fingerprint or ""
    return await store.put_file(
        ref, path, model=fingerprint, n_tokens=n_tokens(path), crc32=whole_file_crc32(path), **kw
    )


def same_bytes(a: Path, b: Path) -> bool:
    return a.read_bytes() == b.read_bytes()


async def restores(store: BlobStore, ref: SlotRef, source: Path, dest: Path) -> None:
    await store.get_to_file(ref, dest)
    assert same_bytes(dest, source), ref


async def counter(store: ChunkedStore, tenant: str = "acme") -> int:
    return int(await store.ledger._redis.get(Keyspace(REDIS_PREFIX).stored_bytes(tenant)) or 0)


async def assert_counter_exact(store: ChunkedStore, tenant: str = "acme") -> None:
    assert await counter(store, tenant) == await store.stored_bytes(tenant)


def files_under(root: Path, *suffixes: str) -> set[str]:
    """Keys of the objects on disk (relative to the store root) ending in one of ``suffixes``."""
    return {
        p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name.endswith(suffixes)
    }


def named_by_manifests(root: Path, tenant: str) -> set[str]:
    """Every piece and tail the manifests on disk name, computed from the documented key layout
    (``{tenant}/.chunks/{ns[:32]}/{name}.kv|.ck``, ``{tenant}/{session}/{generation}.tail``)."""
    out = set()
    for m in (root / PREFIX / tenant).rglob("*.manifest"):
        doc = json.loads(m.read_bytes())
        plan, folder = doc["plan"], f"{PREFIX}/{tenant}/.chunks/{doc['ns'][:32]}"
        out |= {f"{folder}/{name}.kv" for name, _ in plan["chunks"]}
        out |= {f"{folder}/{entry[1]}.ck" for entry in plan["checkpoints"]}
        out.add(m.relative_to(root).as_posix().removesuffix(".manifest") + ".tail")
    return out


def pieces_and_tails(root: Path, tenant: str) -> set[str]:
    """Keys of the tenant's pieces and tails on disk."""
    return {f"{PREFIX}/{tenant}/{k}" for k in files_under(root / PREFIX / tenant, ".kv", ".ck", ".tail")}


async def within(aw: Awaitable[T], what: str, timeout_s: float = 30.0) -> T:
    try:
        return await asyncio.wait_for(aw, timeout_s)
    except TimeoutError:
        raise AssertionError(f"{what}: not done after {timeout_s}s") from None


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
    with pytest.raises(Conflict):
        await put(store, ref, src)
    await assert_counter_exact(store)


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
    with pytest.raises(NotFound):
        await store.head(ref)
    with pytest.raises(NotFound):
        await store.get_to_file(ref, tmp_path / "x.slot")
    assert not (tmp_path / "x.slot").exists()
    assert [i async for i in store.list("acme")] == []
    await store.delete(ref)  # absent: not an error
    assert (await store.collect("acme")).deleted == 0


async def test_two_saves_of_one_generation_at_once_one_conflicts(
    store: ChunkedStore, inner: Faulty, slots: Slots, tmp_path: Path
) -> None:
    """BlobStore.put_file's contract: Conflict if the generation exists — also for two writers at
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

    inner.hooks["object_exists"] = check_together
    sources = (slots.grow[1], slots.grow[2])
    tasks = [asyncio.create_task(put(store, ref, src)) for src in sources]
    for task in tasks:
        task.add_done_callback(lambda _: go_on.set())
    results = await asyncio.gather(*tasks, return_exceptions=True)
    del inner.hooks["object_exists"]
    won = [src for src, r in zip(sources, results, strict=True) if not isinstance(r, BaseException)]
    assert [type(r) for r in results if isinstance(r, BaseException)] == [Conflict]
    await restores(store, ref, won[0], tmp_path / "won.slot")
    # the claim went with the winner: the generation is now taken by its manifest, the next is free
    assert not await store.ledger._redis.keys("*:chunks:writing:*")
    with pytest.raises(Conflict):
        await put(store, ref, won[0])
    await put(store, SlotRef("acme", "s1", 2), slots.grow[3])
    await store.collect("acme")
    await assert_counter_exact(store)


async def test_a_save_waiting_for_a_collector_keeps_its_generation(
    redis_client: Any, inner: Faulty, slots: Slots, eventually: Callable[..., Awaitable[None]]
) -> None:
    """A save that claimed its generation, then waited for a collector longer than its lease lasts,
    still commits (its lease starts when the collector is gone): a second save of the same
    generation started meanwhile must get Conflict."""
    store = ChunkedStore(inner, make_ledger(redis_client, lease_s=2.0))
    ref = SlotRef("acme", "s1", 1)
    checked = [0]

    async def count(key: str) -> None:
        if key == store.key_for(ref):
            checked[0] += 1

    async def a_waits() -> bool:
        return checked[0] == 1

    inner.hooks["object_exists"] = count
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
    assert [type(r) for r in results if isinstance(r, BaseException)] == [Conflict]
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
    await restores(store, SlotRef("acme", "s1", 1), slots.grow[-1], tmp_path / "a.slot")
    await restores(store, SlotRef("acme", "s1", 2), slots.grow_more, tmp_path / "b.slot")
    await assert_counter_exact(store)


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
    await restores(store, SlotRef("acme", "s1", 1), slots.grow[-1], tmp_path / "s1.slot")
    await restores(store, SlotRef("acme", "b1", 1), slots.branch, tmp_path / "b1.slot")
    await assert_counter_exact(store)


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

    async def die(key: str) -> None:
        if key.endswith(".manifest"):
            raise StoreUnavailable("injected: the process died before the manifest")

    inner.hooks["put_object"] = die
    with pytest.raises(StoreUnavailable):
        await put(store, bad, slots.grow[3])
    del inner.hooks["put_object"]
    orphans = pieces_and_tails(inner.root, "acme") - before
    assert any(k.endswith(".kv") for k in orphans) and f"{PREFIX}/acme/s1/{2:020d}.tail" in orphans
    assert [i.ref async for i in store.list("acme")] == [good]
    assert [i.ref async for i in store.list("acme", "s1")] == [good]
    with pytest.raises(NotFound):
        await store.head(bad)
    with pytest.raises(NotFound):
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

    async def die(key: str) -> None:
        if key.endswith(".manifest"):
            raise StoreUnavailable("injected")

    inner.hooks["put_object"] = die
    with pytest.raises(StoreUnavailable):
        await put(store, ref, slots.grow[2])
    del inner.hooks["put_object"]
    meta = await put(store, ref, slots.grow[2])  # not a Conflict: nothing was committed
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


# ------------------------------------------------------------------------------------- restore paths
class _CountedSegments(chunkstore._Segments):
    made = 0

    def __init__(self) -> None:
        super().__init__()
        type(self).made += 1


class _NoSegments:
    def __init__(self) -> None:
        raise AssertionError("the parallel writer was used for a plan without body_crc32")


def _rewrite_plan(inner: Faulty, ref: SlotRef, **changes: Any) -> dict[str, Any]:
    """Change the stored manifest's plan: a value of None drops the field."""
    path = inner.root / PREFIX / ref.tenant / ref.session / f"{ref.generation:020d}.manifest"
    doc = json.loads(path.read_bytes())
    for key, value in changes.items():
        if value is None:
            doc["plan"].pop(key, None)
        else:
            doc["plan"][key] = value
    path.write_bytes(json.dumps(doc).encode())
    plan: dict[str, Any] = doc["plan"]
    return plan


@pytest.mark.parametrize("which", ["grow3", "branch", "rec1"])
async def test_restores_write_in_parallel_and_exactly(
    store: ChunkedStore, slots: Slots, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    """A manifest records the trailer's body CRC: the restore gathers the file's segments and writes
    them with several threads while another computes the CRC; the bytes are the original's."""
    src = {"grow3": slots.grow[3], "branch": slots.branch, "rec1": slots.recurrent[1]}[which]
    monkeypatch.setattr(chunkstore, "_Segments", _CountedSegments)
    monkeypatch.setattr(_CountedSegments, "made", 0)
    ref = SlotRef("acme", "s1", 1)
    await put(store, ref, src)
    await restores(store, ref, src, tmp_path / "back.slot")
    assert _CountedSegments.made == 1


async def test_a_manifest_without_body_crc_restores_in_one_pass(
    store: ChunkedStore, inner: Faulty, slots: Slots, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Manifests written before the body CRC (and the bounds) were recorded: the restore writes
    the file in one pass, computing the trailer, and gives back exactly the original bytes."""
    refs = [(SlotRef("acme", "s1", 1), slots.grow[3]), (SlotRef("acme", "r1", 1), slots.recurrent[1])]
    for ref, src in refs:
        await put(store, ref, src)
        plan = _rewrite_plan(inner, ref, body_crc32=None, bounds=None)
        assert "body_crc32" not in plan and "bounds" not in plan
    monkeypatch.setattr(chunkstore, "_Segments", _NoSegments)
    for ref, src in refs:
        await restores(store, ref, src, tmp_path / f"{ref.session}.slot")
        assert (await store.head(ref)).crc32 == whole_file_crc32(src)
    # and a damaged piece is still named on that path
    victim = sorted(inner.root.rglob("*.kv"))[0]
    _flip(victim, victim.stat().st_size // 2)
    with pytest.raises(ChecksumError, match=victim.name):
        await store.get_to_file(refs[0][0], tmp_path / "bad.slot")
    assert not (tmp_path / "bad.slot").exists()


async def test_a_wrong_body_crc_in_a_manifest_is_not_restored(
    store: ChunkedStore, inner: Faulty, slots: Slots, tmp_path: Path
) -> None:
    src, ref = slots.grow[3], SlotRef("acme", "s1", 1)
    await put(store, ref, src)
    good = read_slot_file(src).body_crc32
    _rewrite_plan(inner, ref, body_crc32=good ^ 1)
    dest = tmp_path / "dest.slot"
    try:
        await store.get_to_file(ref, dest)
    except (ChecksumError, SlotFileError):
        assert not dest.exists()  # refused: what the restore promises
        return
    assert read_slot_file(dest).checksum_ok, "restored a file whose body CRC is wrong"
    assert same_bytes(dest, src)


# ------------------------------------------------------------------------------------ damaged objects
def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "where", ["kv-start", "kv-middle", "kv-end", "ck-middle", "tail-data", "kv-truncated"]
)
async def test_a_damaged_piece_fails_the_restore_and_leaves_dest_alone(
    store: ChunkedStore, inner: Faulty, slots: Slots, tmp_path: Path, where: str
) -> None:
    ref = SlotRef("acme", "s1", 1)
    await put(store, ref, slots.grow[3])
    kind, at = where.split("-")
    if kind == "tail":
        target = inner.root / PREFIX / "acme" / "s1" / f"{1:020d}.tail"
    else:
        target = sorted(inner.root.rglob(f"*.{kind}"))[0]
    size = target.stat().st_size
    if at == "truncated":
        target.write_bytes(target.read_bytes()[:-1])
    else:
        _flip(target, {"start": 0, "middle": size // 2, "end": size - 1, "data": size // 2}[at])
    dest = tmp_path / "out" / "dest.slot"
    dest.parent.mkdir()
    dest.write_bytes(b"the previous file")
    with pytest.raises(ChecksumError):
        await store.get_to_file(ref, dest)
    assert dest.read_bytes() == b"the previous file"
    assert sorted(p.name for p in dest.parent.iterdir()) == ["dest.slot"]  # no temporary left


@pytest.mark.parametrize("offset", [0, 4])
async def test_a_damaged_tail_header_is_a_checksum_error(
    store: ChunkedStore, inner: Faulty, slots: Slots, tmp_path: Path, offset: int
) -> None:
    """Damage in a tail's framing makes the assembly fail; the tail's name carries its CRC, so the
    restore names the damaged object with a storage ChecksumError (not a slot-file parse error)."""
    ref = SlotRef("acme", "s1", 1)
    await put(store, ref, slots.grow[3])
    _flip(inner.root / PREFIX / "acme" / "s1" / f"{1:020d}.tail", offset)
    with pytest.raises(ChecksumError):
        await store.get_to_file(ref, tmp_path / "dest.slot")


async def test_a_missing_piece_or_damaged_manifest_fails_the_restore(
    store: ChunkedStore, inner: Faulty, slots: Slots, tmp_path: Path
) -> None:
    ref = SlotRef("acme", "s1", 1)
    await put(store, ref, slots.grow[3])
    dest = tmp_path / "dest.slot"
    dest.write_bytes(b"old")
    manifest = inner.root / PREFIX / "acme" / "s1" / f"{1:020d}.manifest"
    good = manifest.read_bytes()
    for bad in (
        b"{",
        b"[]",
        json.dumps({**json.loads(good), "generation": 2}).encode(),
        json.dumps({**json.loads(good), "format": "other"}).encode(),
        json.dumps({**json.loads(good), "plan": {}}).encode(),
    ):
        manifest.write_bytes(bad)
        with pytest.raises(SlotFileError):
            await store.get_to_file(ref, dest)
        with pytest.raises(SlotFileError):
            await store.head(ref)
    manifest.write_bytes(good)
    sorted(inner.root.rglob("*.kv"))[0].unlink()
    with pytest.raises(StorageError):
        await store.get_to_file(ref, dest)
    assert dest.read_bytes() == b"old"


async def test_a_damaged_manifest_keeps_every_piece_at_collection(
    store: ChunkedStore, inner: Faulty, slots: Slots
) -> None:
    await put(store, SlotRef("acme", "s1", 1), slots.grow[3])
    await put(store, SlotRef("acme", "s2", 1), slots.grow[1])
    await store.delete(SlotRef("acme", "s2", 1))
    (inner.root / PREFIX / "acme" / "s1" / f"{1:020d}.manifest").write_bytes(b"{ damaged")
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
    with pytest.raises(Conflict):
        await put(store, old, slots.grow[1])
    await store.collect("acme")
    await restores(store, old, slots.grow[1], tmp_path / "old2.slot")  # collection leaves v1 files alone
    await store.delete(old)
    assert [i.ref async for i in store.list("acme")] == [new]
    with pytest.raises(NotFound):
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

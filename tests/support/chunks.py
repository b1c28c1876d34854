"""Slot files from the real engine and helpers shared by the chunked-store tests
(tests/storage/chunks/test_chunkstore.py, test_chunk_collection.py)."""

from __future__ import annotations

import asyncio
import json
import mmap
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

import native
from storage.blobs.blobstore import BlobStore
from storage.blobs.localstore import LocalStore
from storage.chunks.chunking import CHUNK_TOKENS, Split, split
from storage.chunks.chunkstore import ChunkedStore
from storage.chunks.ledger import ChunkLedger
from storage.ids import SlotRef
from storage.index.keyspace import Keyspace
from storage.slotfile.reader import read_slot_file, read_tokens, whole_file_crc32

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

    async def view_object(self, key: str) -> bytes | mmap.mmap:
        await self._hook("get_object", key)
        return await super().view_object(key)

    async def view_objects(self, keys: Sequence[str], gate: asyncio.Semaphore) -> list[bytes | mmap.mmap]:
        for key in keys:
            await self._hook("get_object", key)
        return await super().view_objects(keys, gate)

    async def object_size(self, key: str) -> int | None:
        await self._hook("object_size", key)
        return await super().object_size(key)

    async def delete_object(self, key: str) -> None:
        await self._hook("delete_object", key)
        await super().delete_object(key)


def make_ledger(redis: Any, **kw: Any) -> ChunkLedger:
    # lease_s must stay above put_file's 30 s commit margin (SaveLease.check's default)
    opts: dict[str, Any] = {"lease_s": 60.0, "collect_s": 30.0, "wait_s": 20.0} | kw
    return ChunkLedger(redis, prefix=REDIS_PREFIX, **opts)


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


async def assert_intact(store: ChunkedStore, saved: dict[SlotRef, Path], into: Path) -> None:
    """Every generation in `saved` reads back (into `into`) byte for byte the file it was saved from,
    and the tenant's byte counter agrees with the store."""
    for ref, source in saved.items():
        await restores(store, ref, source, into / f"{ref.tenant}-{ref.session}-{ref.generation}.slot")
    await assert_counter_exact(store)


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


def make_slots(tiny_model: Callable[..., str], tmp_path_factory: pytest.TempPathFactory) -> Slots:
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

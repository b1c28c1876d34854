"""Chunks shared where sessions agree, per tenant: forks of a long session and sessions with one
system prompt store the common part once; another tenant stores its own copy. Real slot files from
the real engine (the tiny hybrid), a real store and the in-process ledger."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path

import pytest

import native
from storage.blobs.localstore import LocalStore
from storage.chunks.chunking import CHUNK_TOKENS, split
from storage.chunks.chunkstore import ChunkedStore
from storage.chunks.ledger import ChunkLedger
from storage.ids import SlotRef, chunks_prefix
from storage.index.keyspace import in_process_redis
from storage.slotfile.reader import read_slot_file

PREFIX_TOKENS = 4000


@pytest.fixture(scope="module")
def engine(tiny_model: Callable[..., str]) -> Iterator[native.Engine]:
    config = native.EngineConfig(tiny_model("qwen35"), n_ctx=8192, n_slots=1, checkpoint_interval=1024)
    with closing(native.Engine(config)) as eng:
        yield eng


def _save(eng: native.Engine, tokens: list[int], path: Path, hints: list[int]) -> Path:
    """The slot after prefilling ``tokens`` (and 4 generated), saved; slot 0 each time, emptied
    first, so equal prefixes are computed the same way."""
    eng.erase_slot(0)
    p = native.RequestParams(tokens)
    p.n_predict, p.temperature, p.checkpoint_hints = 4, 0.0, hints
    eng.generate(0, p)
    eng.save_slot(0, str(path))
    return path


def _prefix(eng: native.Engine) -> list[int]:
    text = "System: you are an agent; tools are read(path), write(path, text), run(cmd). " * 400
    tokens = eng.tokenize(text)
    assert len(tokens) >= PREFIX_TOKENS
    return tokens[:PREFIX_TOKENS]


def _kv_pieces(store_root: Path, tenant: str) -> set[str]:
    folder = store_root / chunks_prefix("sk", tenant)
    return {p.name for p in folder.rglob("*.kv")}


async def test_forks_add_only_their_own_tokens(engine: native.Engine, tmp_path: Path) -> None:
    base = _prefix(engine)
    parent = _save(engine, base, tmp_path / "parent.slot", [PREFIX_TOKENS])
    full = read_slot_file(parent)
    s = split(parent.read_bytes(), full, scope="acme")
    per_token = s.layout.bytes_per_token() if s.layout else 0
    checkpoint = max(len(p.data) for _, p in s.checkpoints)
    async with ChunkedStore(
        LocalStore(tmp_path / "blobs", prefix="sk"), ChunkLedger(in_process_redis())
    ) as st:
        await st.put_file(SlotRef("acme", "main", 1), parent, model="m", n_tokens=full.n_tokens)
        forks = []
        for i in range(8):
            own = engine.tokenize(f" Fork {i}: try approach number {i} on the failing test.")
            path = _save(
                engine, base + own, tmp_path / f"fork{i}.slot", [PREFIX_TOKENS, PREFIX_TOKENS + len(own)]
            )
            meta = await st.put_file(SlotRef("acme", f"main.f{i}", 1), path, model="m", n_tokens=0)
            forks.append((len(own) + 4, meta.written, meta.size))
    for new_tokens, written, size in forks:
        # Its own tokens' bytes — their KV (with the chunk they share with the prefix's last
        # partial chunk) and the state they end in (the tail's recurrent state and logits) — plus
        # one checkpoint (where its prompt ends): never the prefix again.
        bound = (new_tokens + CHUNK_TOKENS) * per_token + 2 * checkpoint + 64 * 1024
        assert written <= bound, (written, bound)
        assert written < 0.2 * size, (written, size)


async def test_one_system_prompt_is_stored_once_per_tenant(engine: native.Engine, tmp_path: Path) -> None:
    base = _prefix(engine)
    root = tmp_path / "blobs"
    async with ChunkedStore(LocalStore(root, prefix="sk"), ChunkLedger(in_process_redis())) as st:
        for tenant, sessions in (("acme", 16), ("beta", 2)):
            for i in range(sessions):
                own = engine.tokenize(f" User {i} asks: why does test number {i} fail?")
                path = _save(engine, base + own, tmp_path / f"{tenant}{i}.slot", [PREFIX_TOKENS])
                await st.put_file(SlotRef(tenant, f"s{i}", 1), path, model="m", n_tokens=0)
        shared = PREFIX_TOKENS // CHUNK_TOKENS  # whole chunks inside the common prefix
        acme, beta = _kv_pieces(root, "acme"), _kv_pieces(root, "beta")
        # the prefix's whole chunks and its piece up to the checkpoint at its end are stored once
        # for 16 sessions (not 16 times); each session adds one piece of its own after that
        assert len(acme) == shared + 1 + 16
        # the second tenant stored its own copy, under its own names and folder
        assert len(beta) == shared + 1 + 2 and acme.isdisjoint(beta)

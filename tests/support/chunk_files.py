"""Slot files of each tiny model architecture, written by the real native engine, and what the
chunking tests do with them (tests/storage/chunks/test_chunking.py, test_placement.py; the
``files`` fixture is in that folder's conftest)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import native
from storage.chunks.chunking import CHUNK_TOKENS, Split, split
from storage.slotfile.reader import SlotFile, read_slot_file, read_tokens

ARCHS = ["qwen35", "llama", "gemma2", "mamba2", "lfm2"]


@dataclass(frozen=True)
class Files:
    """One engine's slot files: ``g1`` (> 2 chunks) saved from slot 0, ``g2`` (``g1`` plus a few
    tokens, same slot), ``moved`` (``g1`` restored into slot 1, then the same few tokens), ``fork``
    (slot 0 again: the first 300 prompt tokens of ``g1``, then other text) and ``branch`` (``g1``
    restored into slot 1, then its tokens up to its last checkpoint, which lies in its last partial
    cell, followed by other text — a regenerated answer)."""

    g1: Path
    g2: Path
    moved: Path
    fork: Path
    branch: Path


def _generate(eng: Any, slot: int, prompt: list[int], n_predict: int, hints: list[int] | None = None) -> None:
    p = native.RequestParams(prompt)
    p.n_predict, p.temperature = n_predict, 0.0
    if hints:
        p.checkpoint_hints = hints
    eng.generate(slot, p)


def make_files(model: str, folder: Path, **config: Any) -> Files:
    folder.mkdir(parents=True, exist_ok=True)
    eng = native.Engine(native.EngineConfig(model, n_ctx=4096, n_slots=2, checkpoint_interval=64, **config))
    try:
        prompt = eng.tokenize("some text " * 300)
        assert len(prompt) > 2 * CHUNK_TOKENS
        _generate(eng, 0, prompt, 4, [30])
        eng.save_slot(0, str(folder / "g1.slot"))
        more = eng.slot_tokens(0) + eng.tokenize(" more")
        _generate(eng, 0, more, 2)
        eng.save_slot(0, str(folder / "g2.slot"))
        eng.restore_slot(1, str(folder / "g1.slot"))
        _generate(eng, 1, more, 2)
        eng.save_slot(1, str(folder / "moved.slot"))
        _generate(eng, 0, prompt[:300] + eng.tokenize(" other words" * 30), 2)
        eng.save_slot(0, str(folder / "fork.slot"))
    finally:
        eng.close()
    # in a fresh engine (same model and context: the same namespace), so that the restored cells and
    # the new ones lie in the cache in position order (else llama.cpp writes them out of order and
    # the file is not chunked)
    g1 = read_slot_file(folder / "g1.slot")
    cut = last_cell_checkpoints(g1)[-1]
    eng = native.Engine(native.EngineConfig(model, n_ctx=4096, n_slots=2, checkpoint_interval=64, **config))
    try:
        eng.restore_slot(1, str(folder / "g1.slot"))
        _generate(eng, 1, read_tokens(g1)[:cut] + eng.tokenize(" other words" * 10), 2)
        eng.save_slot(1, str(folder / "branch.slot"))
    finally:
        eng.close()
    return Files(*(folder / f"{name}.slot" for name in ("g1", "g2", "moved", "fork", "branch")))


def last_cell_checkpoints(sf: SlotFile, chunk_tokens: int = CHUNK_TOKENS) -> list[int]:
    """The checkpoint positions inside the file's last partial cell, sorted (where extra pieces end)."""
    m = sf.n_tokens // chunk_tokens * chunk_tokens
    return sorted({c.n_tokens for c in sf.checkpoints if m < c.n_tokens < sf.n_tokens})


def load(path: Path, scope: str = "acme", chunk_tokens: int = CHUNK_TOKENS) -> tuple[bytes, SlotFile, Split]:
    data = path.read_bytes()
    sf = read_slot_file(path)
    assert sf.checksum_ok
    return data, sf, split(data, sf, scope=scope, chunk_tokens=chunk_tokens)


def objects_of(s: Split) -> dict[str, bytes]:
    out = {p.name: p.data for p in s.chunks}
    out.update({p.name: p.data for _, p in s.checkpoints})
    out[s.tail.name] = s.tail.data
    return out


def through_json(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan as a manifest stores it and reads it back."""
    out: dict[str, Any] = json.loads(json.dumps(plan))
    return out

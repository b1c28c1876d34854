"""A v1 slot file taken apart into content-addressed pieces, and put back together byte for byte.

Pure functions over bytes; :mod:`storage.chunks.chunkstore` moves the pieces. A slot file splits into:

* **KV chunks** — the attention KV of token range ``[k·C, (k+1)·C)`` (``C`` = :data:`CHUNK_TOKENS`)
  of the state's first KV cache: the full-attention cache of a plain, hybrid or sliding-window
  model. A chunk holds the range's token ids, cell records, K rows of every layer and V rows (or,
  for a transposed V, the range's columns). Its name is the running SHA-256 of every token up to
  the chunk's end, seeded with the namespace (tenant scope, model fingerprint, llama state version,
  KV layout and context shape), plus the CRC-32 of its bytes: two sessions share a chunk only when
  their bytes are identical, so a restore always gives back exactly the bytes its session saved.
* **Checkpoints** — each SCKP entry with its logits, named by the running digest of the tokens it
  covers (the recurrent or sliding-window state after them) and its CRC.
* **The tail** — per generation: the tokens and KV cells after the last whole chunk, the rest of
  the state (sliding-window cache, recurrent state), and the slotkeeper records (META, last logits).

The KV cache is chunked only when its layout is the one llama.cpp writes for a single unified
stream with cells at positions ``0..n-1`` in order and types matching META's ``type_k``/``type_v``;
anything else (a pure recurrent model, a context-shifted slot, an unknown layout) keeps the whole
state in the tail, which is always correct. :func:`split` checks its own work: the pieces must
assemble to the original bytes (CRC of the whole file), else it falls back the same way.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import struct
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from storage.errors import SlotFileError
from storage.slotfile.format import (
    BASE_MAGIC,
    CKPT_MAGIC,
    META_MAGIC,
    SECTION_VERSION,
    TAG_CKPT_LOGITS,
    TRAILER,
    TRAILER_MAGIC,
)
from storage.slotfile.reader import SlotFile

CHUNK_TOKENS = 256
NS_VERSION = b"slotkeeper-chunks/1"
# ggml type ids of the KV cache types a slot file's META names (`-ctk`/`-ctv`).
GGML_TYPES = {
    "f32": 0,
    "f16": 1,
    "q4_0": 2,
    "q4_1": 3,
    "q5_0": 6,
    "q5_1": 7,
    "q8_0": 8,
    "iq4_nl": 20,
    "bf16": 30,
}
_U32, _U64, _I32 = struct.Struct("<I"), struct.Struct("<Q"), struct.Struct("<i")
TYPE_ROW = struct.Struct("<iQ")  # type, row size
TYPE_EL = struct.Struct("<iII")  # type, element size, n_embd (transposed V)
_PARTS_MAGIC = b"SKPT"
_SEQ_MAGIC = struct.pack("<I", 0xAF143CD8)  # llama_state_seq_get_data's prefix: magic, then seq id
_CELL_SIZES = (12, 24)  # pos, n_seq_id, [2D position + token: 12], seq_id
# The shape fields of META's context that decide whether KV bytes mean the same thing.
_SHAPE_KEYS = ("n_ctx", "kv_unified", "type_k", "type_v", "swa_full", "flash_attn")


@dataclass(frozen=True)
class KvLayout:
    """The chunkable KV cache's shape: enough to slice it by cells and to write it back."""

    offset: int  # of the cache (its n_stream field) inside the state
    end: int  # state offset where the cache ends (what follows is the rest of the state)
    cell_bytes: int
    v_trans: int
    k: tuple[tuple[int, int], ...]  # per layer: ggml type, row bytes
    v: tuple[tuple[int, int, int], ...]  # per layer: type, row bytes (or element bytes), n_embd (trans)

    def to_json(self) -> dict[str, Any]:
        return {
            "cell_bytes": self.cell_bytes,
            "v_trans": self.v_trans,
            "k": [list(x) for x in self.k],
            "v": [list(x) for x in self.v],
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> KvLayout:
        try:
            return cls(
                0,
                0,
                int(raw["cell_bytes"]),
                int(raw["v_trans"]),
                tuple((int(a), int(b)) for a, b in raw["k"]),
                tuple((int(a), int(b), int(c)) for a, b, c in raw["v"]),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise SlotFileError("bad_layout", f"manifest KV layout is malformed: {exc}") from exc

    def bytes_per_token(self) -> int:
        v = sum(size * n_embd if self.v_trans else size for _, size, n_embd in self.v)
        return 4 + self.cell_bytes + sum(row for _, row in self.k) + v


@dataclass(frozen=True)
class Piece:
    """One object of a split: its content digest, its bytes and their CRC-32."""

    digest: str
    data: bytes
    crc32: int

    @property
    def name(self) -> str:
        """The object's name: digest and CRC (identical names ⇔ identical bytes, in practice)."""
        return f"{self.digest}-{self.crc32:08x}"


@dataclass(frozen=True)
class Split:
    """A slot file as pieces; :func:`assemble` writes the same file back from them."""

    ns: str
    n_tokens: int
    state_version: int
    layout: KvLayout | None
    chunk_tokens: int
    chunks: tuple[Piece, ...]  # KV of [k·C, (k+1)·C) for k < len(chunks)
    checkpoints: tuple[tuple[int, Piece], ...]  # (n_tokens, piece), file order
    tail: Piece
    records: tuple[str, ...]  # SKMD record order: "t<i>" (i-th tail record), "c<j>" (checkpoint j)
    size: int  # of the whole v1 file
    crc32: int  # of the whole v1 file
    seq_id: int = 0  # of the cells (the saving slot's sequence), written back on assembly
    ckpt_seq_ids: tuple[int, ...] = ()  # in each checkpoint's state prefix (its capturing slot's)
    bounds: tuple[int, ...] = (0,)  # chunk i covers [bounds[i], bounds[i+1]); the tail the rest
    body_crc32: int = 0  # the trailer's: of every byte before it

    @property
    def tail_start(self) -> int:
        return self.bounds[-1]


def _table(meta: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = meta.get(name)
    return value if isinstance(value, dict) else {}


def namespace(
    fingerprint: str,
    meta: Mapping[str, Any],
    layout: KvLayout | None,
    state_version: int,
    scope: str,
    chunk_tokens: int = CHUNK_TOKENS,
) -> str:
    """The digest seed: pieces of one namespace are interchangeable where their tokens agree.
    ``scope`` is the sharing scope (a tenant's, or one session's when sharing is off)."""
    context = _table(meta, "context")
    shape = {k: context.get(k) for k in _SHAPE_KEYS}
    seed = json.dumps(
        [scope, fingerprint, state_version, chunk_tokens, shape, layout.to_json() if layout else None],
        sort_keys=True,
    )
    return hashlib.sha256(NS_VERSION + seed.encode()).hexdigest()


def chain(ns: str, tokens: np.ndarray, chunk_tokens: int, n_chunks: int) -> list[bytes]:
    """Running digests ``h[k]`` of the first ``k·C`` tokens, k = 0..n_chunks."""
    h = [hashlib.sha256(ns.encode()).digest()]
    for k in range(n_chunks):
        part = tokens[k * chunk_tokens : (k + 1) * chunk_tokens].astype("<i4").tobytes()
        h.append(hashlib.sha256(h[-1] + part).digest())
    return h


def kv_bounds(n: int, checkpoints: Sequence[int], chunk_tokens: int) -> list[int]:
    """Where KV pieces begin and end: the grid of whole chunks below ``n``, then every checkpoint
    inside the last, partial cell — a fork or the next turn diverges at a checkpoint, so the pieces
    up to it are shared instead of stored again in each tail."""
    m = n // chunk_tokens * chunk_tokens
    return [*range(0, m + 1, chunk_tokens), *sorted({c for c in checkpoints if m < c < n})]


def prefix_digest(heads: Sequence[bytes], tokens: np.ndarray, p: int, chunk_tokens: int) -> bytes:
    """The running digest of the first ``p`` tokens (``heads`` from :func:`chain`)."""
    k = p // chunk_tokens
    if p == k * chunk_tokens:
        return heads[k]
    return hashlib.sha256(heads[k] + tokens[k * chunk_tokens : p].astype("<i4").tobytes()).digest()


def range_digest(heads: Sequence[bytes], tokens: np.ndarray, a: int, b: int, chunk_tokens: int) -> str:
    """A KV piece's name: the tokens up to its end, and where it begins."""
    return hashlib.sha256(
        b"kv" + prefix_digest(heads, tokens, b, chunk_tokens) + a.to_bytes(8, "little")
    ).hexdigest()


def checkpoint_digest(heads: Sequence[bytes], tokens: np.ndarray, n: int, chunk_tokens: int) -> str:
    k = n // chunk_tokens
    rest = tokens[k * chunk_tokens : n].astype("<i4").tobytes()
    return hashlib.sha256(b"ckpt" + heads[k] + rest).hexdigest()


# -- parts framing ----------------------------------------------------------------------------------
def pack_parts(parts: Sequence[bytes]) -> bytes:
    head = _PARTS_MAGIC + _U32.pack(len(parts)) + b"".join(_U64.pack(len(p)) for p in parts)
    return head + b"".join(parts)


def unpack_parts(data: bytes, what: str) -> list[memoryview]:
    """The parts of :func:`pack_parts`; every length is checked against the bytes there."""
    view = memoryview(data)
    if len(view) < 8 or bytes(view[:4]) != _PARTS_MAGIC:
        raise SlotFileError("bad_magic", f"{what}: not a slotkeeper piece")
    (n,) = _U32.unpack_from(view, 4)
    pos = 8 + 8 * n
    if n > 1 << 16 or pos > len(view):
        raise SlotFileError("truncated", f"{what}: {n} parts do not fit {len(view)} bytes")
    out = []
    for i in range(n):
        (length,) = _U64.unpack_from(view, 8 + 8 * i)
        if length > len(view) - pos:
            raise SlotFileError("truncated", f"{what}: part {i} runs past the end")
        out.append(view[pos : pos + length])
        pos += length
    if pos != len(view):
        raise SlotFileError("bad_layout", f"{what}: {len(view) - pos} bytes after the last part")
    return out


# -- parsing the KV cache ---------------------------------------------------------------------------
def parse_kv(state: memoryview, n_tokens: int, meta: Mapping[str, Any]) -> KvLayout | None:
    """The layout of the state's first KV cache, or None when it is not one we can chunk."""
    model, context = _table(meta, "model"), _table(meta, "context")
    if model.get("recurrent") and not model.get("hybrid"):
        return None
    k_id, v_id = GGML_TYPES.get(str(context.get("type_k"))), GGML_TYPES.get(str(context.get("type_v")))
    if k_id is None or v_id is None or n_tokens == 0 or len(state) < 8:
        return None
    n_stream, cells = _U32.unpack_from(state, 0)[0], _U32.unpack_from(state, 4)[0]
    if n_stream != 1 or cells != n_tokens:
        return None
    for cell_bytes in _CELL_SIZES:
        layout = _parse_data(state, cells, cell_bytes, k_id, v_id, int(model.get("n_layer") or 0))
        if layout is not None:
            return layout
    return None


def _parse_data(
    state: memoryview, cells: int, cell_bytes: int, k_id: int, v_id: int, max_layers: int
) -> KvLayout | None:
    meta_end = 8 + cells * cell_bytes
    if meta_end + 8 > len(state):
        return None
    recs = np.frombuffer(state, dtype="<i4", count=cells * cell_bytes // 4, offset=8)
    recs = recs.reshape(cells, cell_bytes // 4)
    if not (
        np.array_equal(recs[:, 0], np.arange(cells))
        and (recs[:, 1] == 1).all()
        and (recs[:, -1] == recs[0, -1]).all()
    ):
        return None
    v_trans, n_layer = _U32.unpack_from(state, meta_end)[0], _U32.unpack_from(state, meta_end + 4)[0]
    if v_trans not in (0, 1) or not 0 < n_layer <= max(max_layers, 1):
        return None
    pos, k, v = meta_end + 8, [], []
    for _ in range(n_layer):
        if pos + TYPE_ROW.size > len(state):
            return None
        t, row = TYPE_ROW.unpack_from(state, pos)
        pos += TYPE_ROW.size + cells * row
        if t != k_id or row == 0 or pos > len(state):
            return None
        k.append((t, row))
    for _ in range(n_layer):
        if v_trans:
            if pos + TYPE_EL.size > len(state):
                return None
            t, el, n_embd = TYPE_EL.unpack_from(state, pos)
            pos += TYPE_EL.size + cells * el * n_embd
            v.append((t, el, n_embd))
        else:
            if pos + TYPE_ROW.size > len(state):
                return None
            t, row = TYPE_ROW.unpack_from(state, pos)
            pos += TYPE_ROW.size + cells * row
            v.append((t, row, 0))
        if t != v_id or v[-1][1] == 0 or pos > len(state):
            return None
    return KvLayout(0, pos, cell_bytes, v_trans, tuple(k), tuple(v))


def _kv_blocks(state: memoryview, layout: KvLayout, cells: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """The cell records as (cells, cell_bytes) and each layer's K/V data as a 2-D uint8 view whose
    columns (trans V) or rows (K, V) are indexed by cell."""
    buf = np.frombuffer(state, dtype=np.uint8)
    recs = buf[8 : 8 + cells * layout.cell_bytes].reshape(cells, layout.cell_bytes)
    pos, blocks = 8 + cells * layout.cell_bytes + 8, []
    for _, row in layout.k:
        pos += TYPE_ROW.size
        blocks.append(buf[pos : pos + cells * row].reshape(cells, row))
        pos += cells * row
    for _, size, n_embd in layout.v:
        if layout.v_trans:
            pos += TYPE_EL.size
            blocks.append(buf[pos : pos + cells * size * n_embd].reshape(n_embd, cells * size))
            pos += cells * size * n_embd
        else:
            pos += TYPE_ROW.size
            blocks.append(buf[pos : pos + cells * size].reshape(cells, size))
            pos += cells * size
    return recs, blocks


def _cell_slice(layout: KvLayout, i: int, block: np.ndarray, a: int, b: int) -> np.ndarray:
    if layout.v_trans and i >= len(layout.k):
        el = layout.v[i - len(layout.k)][1]
        return block[:, a * el : b * el]
    return block[a:b]


def _range_payload(
    tokens: np.ndarray, recs: np.ndarray, blocks: list[np.ndarray], layout: KvLayout, a: int, b: int
) -> bytes:
    cells = recs[a:b].copy()
    cells[:, -4:] = 0  # the sequence id is the saving slot's, not content: the plan carries it
    parts = [tokens[a:b].astype("<i4").tobytes(), cells.tobytes()]
    for i, block in enumerate(blocks):
        parts.append(np.ascontiguousarray(_cell_slice(layout, i, block, a, b)).tobytes())
    return pack_parts(parts)


def _piece(digest: str, data: bytes) -> Piece:
    return Piece(digest, data, zlib.crc32(data))


# -- split ------------------------------------------------------------------------------------------
def split(data: bytes, sf: SlotFile, *, scope: str, chunk_tokens: int = CHUNK_TOKENS) -> Split:
    """Take a validated slot file (``sf`` read from ``data``'s bytes) apart; see the module doc."""
    view = memoryview(data)
    n = sf.n_tokens
    tokens = np.frombuffer(view, dtype="<i4", count=n, offset=12)
    state = view[sf.state_offset : sf.base_len]
    layout = parse_kv(state, n, sf.meta)
    whole = zlib.crc32(data)
    out = _split(view, sf, tokens, state, layout, scope, chunk_tokens, whole)
    if layout is not None and crc_of(out, _load(out)) != whole:  # never happens; if it did: stay correct
        out = _split(view, sf, tokens, state, None, scope, chunk_tokens, whole)
    return out


def _split(
    view: memoryview,
    sf: SlotFile,
    tokens: np.ndarray,
    state: memoryview,
    layout: KvLayout | None,
    scope: str,
    chunk_tokens: int,
    whole: int,
) -> Split:
    n = sf.n_tokens
    ns = namespace(sf.fingerprint or "", sf.meta, layout, sf.state_version, scope, chunk_tokens)
    heads = chain(ns, tokens, chunk_tokens, n // chunk_tokens)
    chunks: list[Piece] = []
    tail_parts: list[bytes]
    bounds = [0]
    if layout is not None:
        recs, blocks = _kv_blocks(state, layout, n)
        bounds = kv_bounds(n, [ck.n_tokens for ck in sf.checkpoints], chunk_tokens)
        for a, b in itertools.pairwise(bounds):
            payload = _range_payload(tokens, recs, blocks, layout, a, b)
            chunks.append(_piece(range_digest(heads, tokens, a, b, chunk_tokens), payload))
        tail_parts = [_range_payload(tokens, recs, blocks, layout, bounds[-1], n), bytes(state[layout.end :])]
        seq_id = int.from_bytes(bytes(recs[0, -4:]), "little", signed=True)
    else:
        tail_parts, seq_id = [tokens.astype("<i4").tobytes(), bytes(state)], 0
    checkpoints: list[tuple[int, Piece]] = []
    ckpt_seqs: list[int] = []
    logits = {r.ckpt_index: r for r in sf.records if r.tag == TAG_CKPT_LOGITS}
    for j, ck in enumerate(sf.checkpoints):
        start = ck.target_offset - 16 - 8  # the entry's head: i64 n_tokens, i32, i32, then u64 length
        end = ck.target_offset + ck.target_bytes_len + 16 + ck.draft_bytes_len + ck.spec_bytes_len
        rec = logits.get(j)
        entry = bytearray(view[start:end])
        ckpt_seqs.append(0)
        if ck.target_bytes_len >= 8 and entry[24:28] == _SEQ_MAGIC:  # the state's own seq-id prefix
            ckpt_seqs[-1] = int.from_bytes(entry[28:32], "little", signed=True)
            entry[28:32] = bytes(4)
        parts = [bytes(entry)]
        if rec is not None:
            parts.append(bytes(view[rec.offset + 4 : rec.offset + rec.length]))
        digest = checkpoint_digest(heads, tokens, ck.n_tokens, chunk_tokens)
        checkpoints.append((ck.n_tokens, _piece(digest, pack_parts(parts))))
    order: list[str] = []
    for rec in sf.records:
        if rec.tag == TAG_CKPT_LOGITS and rec.ckpt_index is not None:
            order.append(f"c{rec.ckpt_index}")
        else:
            order.append(f"t{len(tail_parts) - 2}")
            payload = bytes(view[rec.offset : rec.offset + rec.length])
            tail_parts.append(_U32.pack(rec.tag) + _U32.pack(rec.flags) + payload)
    tail = _piece(hashlib.sha256(b"tail" + heads[-1]).hexdigest(), pack_parts(tail_parts))
    return Split(
        ns,
        n,
        sf.state_version,
        layout,
        chunk_tokens,
        tuple(chunks),
        tuple(checkpoints),
        tail,
        tuple(order),
        len(view),
        whole,
        seq_id,
        tuple(ckpt_seqs),
        tuple(bounds),
        sf.body_crc32,
    )


def _load(s: Split) -> dict[str, bytes]:
    out = {p.name: p.data for p in s.chunks}
    out.update({p.name: p.data for _, p in s.checkpoints})
    out[s.tail.name] = s.tail.data
    return out


# -- assemble ---------------------------------------------------------------------------------------
class _CrcWriter:
    def __init__(self, out: Any, checksum: bool = True) -> None:
        self.out, self.crc, self.n, self.checksum = out, 0, 0, checksum

    def write(self, data: bytes | memoryview | np.ndarray) -> None:
        if not isinstance(data, bytes) and memoryview(data).nbytes == 0:  # type: ignore[arg-type]
            return  # (no cast of an empty 2-D view: the cells of an empty range)
        mv = data if isinstance(data, bytes) else memoryview(data).cast("B")  # type: ignore[arg-type]
        if self.checksum:
            self.crc = zlib.crc32(mv, self.crc)
        self.n += len(mv)
        if self.out is not None:
            self.out.write(mv)

    def write_columns(self, cols: list[np.ndarray]) -> None:
        """The column blocks side by side, row after row (a transposed V cache from its chunks).
        A target whose ``columns`` is true (:class:`storage.chunks.chunkstore`'s file writer) takes them
        as they are, in its ``write_columns``, and interleaves them while writing; anything else
        gets one joined copy."""
        if self.checksum or not getattr(self.out, "columns", False):
            self.write(np.ascontiguousarray(np.concatenate(cols, axis=1)))
            return
        self.n += self.out.write_columns(cols)


def crc_of(s: Split, objects: Mapping[str, bytes]) -> int:
    """The CRC-32 of the file :func:`assemble` would write (nothing written)."""
    return write_v1(None, describe(s), objects)[1]


def describe(s: Split) -> dict[str, Any]:
    """What a manifest records to assemble the file again (objects named by :attr:`Piece.name`)."""
    return {
        "n_tokens": s.n_tokens,
        "state_version": s.state_version,
        "chunk_tokens": s.chunk_tokens,
        "layout": s.layout.to_json() if s.layout else None,
        "chunks": [[p.name, len(p.data)] for p in s.chunks],
        "bounds": list(s.bounds),
        "checkpoints": [
            [n, p.name, len(p.data), seq] for (n, p), seq in zip(s.checkpoints, s.ckpt_seq_ids, strict=True)
        ],
        "tail": [s.tail.name, len(s.tail.data)],
        "records": list(s.records),
        "size": s.size,
        "crc32": s.crc32,
        "body_crc32": s.body_crc32,
        "seq_id": s.seq_id,
    }


def write_v1(
    out: Any, plan: Mapping[str, Any], objects: Mapping[str, bytes], *, checksum: bool = True
) -> tuple[int, int]:
    """Write the v1 slot file a manifest's plan describes from its objects' bytes to ``out`` (any
    object with ``write``; None: nothing); returns (size, crc32 of the whole file). With
    ``checksum=False`` no CRC is computed (0 is returned): the trailer takes the plan's
    ``body_crc32`` and the caller checks the bytes itself. Raises :class:`SlotFileError` when the
    pieces do not fit the plan."""
    try:
        return _write_v1(out, plan, objects, checksum)
    except (KeyError, IndexError, TypeError, ValueError, OverflowError, struct.error) as exc:
        why = f"{type(exc).__name__}: {exc}"
        raise SlotFileError("bad_layout", f"pieces do not fit the manifest: {why}") from exc


def _write_v1(
    out: Any, plan: Mapping[str, Any], objects: Mapping[str, bytes], checksum: bool
) -> tuple[int, int]:
    w = _CrcWriter(out, checksum)
    n = int(plan["n_tokens"])
    layout = KvLayout.from_json(plan["layout"]) if plan["layout"] is not None else None
    tail = unpack_parts(objects[plan["tail"][0]], "tail")
    w.write(struct.pack("<III", BASE_MAGIC, int(plan["state_version"]), n))
    if layout is None:
        if len(tail[0]) != 4 * n:
            raise ValueError("tail tokens do not match n_tokens")
        w.write(tail[0])
    else:
        ranges = [unpack_parts(objects[name], "chunk") for name, _ in plan["chunks"]]
        ranges.append(unpack_parts(bytes(tail[0]), "tail cells"))
        n_parts = 2 + len(layout.k) + len(layout.v)
        if any(len(r) != n_parts for r in ranges) or sum(len(r[0]) for r in ranges) != 4 * n:
            raise ValueError("chunk ranges do not cover the tokens")
        for r in ranges:
            w.write(r[0])
        w.write(_U32.pack(1) + _U32.pack(n))
        seq = _I32.pack(int(plan["seq_id"])) if "seq_id" in plan else None  # absent: pieces kept theirs
        for r in ranges:
            if seq is None:
                w.write(r[1])
                continue
            cells = np.frombuffer(r[1], dtype=np.uint8).reshape(-1, layout.cell_bytes).copy()
            cells[:, -4:] = np.frombuffer(seq, dtype=np.uint8)
            w.write(cells)
        w.write(_U32.pack(layout.v_trans) + _U32.pack(len(layout.k)))
        for i, (t, row) in enumerate(layout.k):
            w.write(TYPE_ROW.pack(t, row))
            for r in ranges:
                w.write(r[2 + i])
        for i, (t, size, n_embd) in enumerate(layout.v):
            part = 2 + len(layout.k) + i
            if layout.v_trans:
                w.write(TYPE_EL.pack(t, size, n_embd))
                w.write_columns([np.frombuffer(r[part], dtype=np.uint8).reshape(n_embd, -1) for r in ranges])
            else:
                w.write(TYPE_ROW.pack(t, size))
                for r in ranges:
                    w.write(r[part])
    return _write_sections(w, plan, objects, tail, checksum)


def write_v1_after_kv(out: Any, plan: Mapping[str, Any], objects: Mapping[str, bytes], at: int) -> int:
    """What follows the KV cache in the v1 file of a plan with a KV layout — the base's tail, the
    checkpoints, the records and the trailer, which carries the plan's ``body_crc32`` — written to
    ``out`` as from offset ``at`` (:attr:`storage.chunks.placement.KvPlacement.end`); the file's
    size. ``objects`` needs the tail and the checkpoints only."""
    try:
        w = _CrcWriter(out, checksum=False)
        w.n = at
        return _write_sections(w, plan, objects, unpack_parts(objects[plan["tail"][0]], "tail"), False)[0]
    except (KeyError, IndexError, TypeError, ValueError, OverflowError, struct.error) as exc:
        why = f"{type(exc).__name__}: {exc}"
        raise SlotFileError("bad_layout", f"pieces do not fit the manifest: {why}") from exc


def _write_sections(
    w: _CrcWriter,
    plan: Mapping[str, Any],
    objects: Mapping[str, bytes],
    tail: list[memoryview],
    checksum: bool,
) -> tuple[int, int]:
    """The base's tail, then the checkpoint and record sections and the trailer."""
    w.write(tail[1])
    base_len = w.n
    ckpts = [unpack_parts(objects[entry[1]], "checkpoint") for entry in plan["checkpoints"]]
    seqs = [_I32.pack(int(entry[3])) if len(entry) > 3 else None for entry in plan["checkpoints"]]
    ckpt_off = ckpt_len = 0
    if ckpts:
        ckpt_off = w.n
        w.write(struct.pack("<III", CKPT_MAGIC, SECTION_VERSION, len(ckpts)))
        for c, seq in zip(ckpts, seqs, strict=True):
            if seq is not None and len(c[0]) >= 32 and bytes(c[0][24:28]) == _SEQ_MAGIC:
                w.write(c[0][:28])  # the entry as it was, its capturing slot's sequence id put back
                w.write(seq)
                w.write(c[0][32:])
            else:
                w.write(c[0])
        ckpt_len = w.n - ckpt_off
    meta_off = w.n
    order = list(plan["records"])
    w.write(struct.pack("<III", META_MAGIC, SECTION_VERSION, len(order)))
    for item in order:
        kind, idx = item[0], int(item[1:])
        if kind == "t":
            rec = tail[2 + idx]
            tag, flags = _U32.unpack_from(rec, 0)[0], _U32.unpack_from(rec, 4)[0]
            payload: Sequence[bytes | memoryview] = (rec[8:],)
        elif kind == "c":
            tag, flags = TAG_CKPT_LOGITS, 0
            payload = (_U32.pack(idx), ckpts[idx][1])
        else:
            raise ValueError(f"unknown record {item!r}")
        w.write(struct.pack("<IIQ", tag, flags, sum(len(p) for p in payload)))
        for p in payload:
            w.write(p)
    meta_len = w.n - meta_off
    body_crc = w.crc if checksum else int(plan["body_crc32"])
    head = TRAILER.pack(TRAILER_MAGIC, 1, 0, 0, base_len, ckpt_off, ckpt_len, meta_off, meta_len, body_crc, 0)
    trailer = head[:-4] + _U32.pack(zlib.crc32(head[:-4]))
    w.write(trailer)
    return w.n, w.crc


def with_body_crc(trailer: bytes | memoryview, body_crc: int) -> bytes:
    """A v1 trailer with its body CRC set (and its own CRC over it recomputed)."""
    fields = list(TRAILER.unpack(bytes(trailer)))
    fields[-2] = body_crc
    head = TRAILER.pack(*fields)
    return head[:-4] + _U32.pack(zlib.crc32(head[:-4]))


def objects_needed(plan: Mapping[str, Any]) -> Iterator[tuple[str, str, int]]:
    """(kind, name, size) of every object a manifest's plan reads: chunk, checkpoint, tail."""
    for name, size in plan["chunks"]:
        yield "kv", str(name), int(size)
    for entry in plan["checkpoints"]:
        yield "ck", str(entry[1]), int(entry[2])
    yield "tl", str(plan["tail"][0]), int(plan["tail"][1])


def assemble_bytes(plan: Mapping[str, Any], objects: Mapping[str, bytes]) -> bytes:
    buf = io.BytesIO()
    write_v1(buf, plan, objects)
    return buf.getvalue()

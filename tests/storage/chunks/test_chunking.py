"""storage.chunks.chunking against slot files written by the real native engine: pieces assemble back
byte for byte, KV pieces are the whole 256-token cells plus pieces cut at the checkpoints inside the
last partial cell, growing and forked sessions share their leading pieces (a fork that diverges at
such a checkpoint shares the piece ending there), and pieces that do not fit their plan are refused
with SlotFileError (never another exception)."""

from __future__ import annotations

import copy
import hashlib
import io
import itertools
import json
import random
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.chunk_files import (
    ARCHS,
    Files,
    last_cell_checkpoints,
    load,
    objects_of,
    through_json,
)

from storage.chunks import chunking
from storage.chunks.assembly import Segments, write_file
from storage.chunks.chunking import (
    CHUNK_TOKENS,
    Split,
    assemble_bytes,
    chain,
    describe,
    kv_bounds,
    pack_parts,
    prefix_digest,
    range_digest,
    unpack_parts,
    write_v1,
)
from storage.errors import SlotFileError
from storage.slotfile.reader import read_slot_file, read_tokens, verify_slot_file


# ------------------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("arch", [*ARCHS, "llama-fa"])
@pytest.mark.parametrize("which", ["g1", "g2", "moved", "fork", "branch"])
def test_round_trip_is_byte_identical(files: dict[str, Files], arch: str, which: str, tmp_path: Path) -> None:
    path = getattr(files[arch], which)
    data, sf, s = load(path)
    plan = through_json(describe(s))
    out = assemble_bytes(plan, objects_of(s))
    assert out == data
    assert write_v1(None, plan, objects_of(s)) == (len(data), zlib.crc32(data)) == (s.size, s.crc32)
    # the assembled file is a valid slot file saying the same things
    (tmp_path / "back.slot").write_bytes(out)
    back = verify_slot_file(tmp_path / "back.slot", fingerprint=sf.fingerprint)
    assert read_tokens(back) == read_tokens(sf)
    assert s.n_tokens == sf.n_tokens and s.state_version == sf.state_version
    assert [n for n, _ in s.checkpoints] == [c.n_tokens for c in sf.checkpoints]


class _Collector:
    """A ``write`` target keeping copies of what it is given (write_v1 takes any such object)."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: Any) -> None:
        self.parts.append(bytes(data))


@pytest.mark.parametrize("arch", ["qwen35", "llama", "llama-fa", "mamba2"])
@pytest.mark.parametrize("which", ["g1", "moved", "branch"])
def test_unchecksummed_writes_take_the_body_crc_from_the_plan(
    files: dict[str, Files], arch: str, which: str, tmp_path: Path
) -> None:
    """``checksum=False`` computes no CRC (0 is returned) and writes the plan's ``body_crc32`` into
    the trailer: into a segment collector (the restore's, or any object with ``write``) the bytes
    are the checksummed path's, which are the original file's."""
    data, sf, s = load(getattr(files[arch], which))
    plan, objects = through_json(describe(s)), objects_of(s)
    assert plan["body_crc32"] == s.body_crc32 == sf.body_crc32
    collector = _Collector()
    assert write_v1(collector, plan, objects, checksum=False) == (len(data), 0)
    assert b"".join(collector.parts) == assemble_bytes(plan, objects) == data
    segments = Segments(columns=False)  # a transposed V joined into one part
    assert write_v1(segments, plan, objects, checksum=False) == (len(data), 0)
    assert segments.n == len(data)
    out = bytearray(segments.n)
    for offset, view in segments.parts:
        assert isinstance(view, memoryview)
        out[offset : offset + len(view)] = view
    assert bytes(out) == data
    # unverified, as a node restores: a transposed V interleaved from its chunks while written
    # (split by rows among the writing threads), no CRC computed, the same bytes
    assert write_file(tmp_path / "unverified.slot", plan, objects, verify=False) == (len(data), 0)
    assert (tmp_path / "unverified.slot").read_bytes() == data
    assert write_file(tmp_path / "verified.slot", plan, objects) == (len(data), zlib.crc32(data))
    # the trailer is what the plan says (write_v1 does not check it): another body CRC is another
    # file, differing in the trailer's body CRC and its own CRC only, which a reader refuses
    buf = io.BytesIO()
    write_v1(buf, {**plan, "body_crc32": plan["body_crc32"] ^ 1}, objects, checksum=False)
    other = buf.getvalue()
    assert len(other) == len(data) and other != data
    assert {i for i, (x, y) in enumerate(zip(other, data, strict=True)) if x != y} <= set(
        range(len(data) - 8, len(data))
    )
    (tmp_path / "other.slot").write_bytes(other)
    assert read_slot_file(tmp_path / "other.slot").checksum_ok is False


def test_unchecksummed_writes_need_a_valid_body_crc(files: dict[str, Files]) -> None:
    """A plan without ``body_crc32`` (written before it was recorded), or with a bad one, is refused
    with SlotFileError when no CRC is computed; the checksummed path does not read it."""
    data, _, s = load(files["qwen35"].g1)
    plan, objects = through_json(describe(s)), objects_of(s)
    old = {k: v for k, v in plan.items() if k not in ("body_crc32", "bounds")}
    assert write_v1(None, old, objects) == (len(data), zlib.crc32(data))
    _raises_slot_file_error(old, objects, checksum=False)
    bad_values: list[Any] = [None, -1, 2**32, 2**70, "x", [], {}, float("nan"), json.loads("Infinity")]
    for bad in bad_values:
        _raises_slot_file_error({**plan, "body_crc32": bad}, objects, checksum=False)
        assert write_v1(None, {**plan, "body_crc32": bad}, objects) == (len(data), zlib.crc32(data))


@pytest.mark.parametrize(
    ("arch", "cell_bytes", "v_trans"),
    [("qwen35", 24, 1), ("llama", 12, 1), ("gemma2", 12, 1), ("lfm2", 12, 1), ("llama-fa", 12, 0)],
)
def test_attention_kv_is_chunked(files: dict[str, Files], arch: str, cell_bytes: int, v_trans: int) -> None:
    data, sf, s = load(files[arch].g1)
    assert s.layout is not None
    assert (s.layout.cell_bytes, s.layout.v_trans) == (cell_bytes, v_trans)
    # the pieces: the two whole cells, then one per checkpoint inside the last partial cell (g1's
    # prompt ends there: the engine keeps a checkpoint at it), and the tail after the last one
    assert sf.n_tokens // CHUNK_TOKENS == 2
    extra = last_cell_checkpoints(sf)
    assert extra and all(2 * CHUNK_TOKENS < c < sf.n_tokens for c in extra)
    assert s.bounds == (0, CHUNK_TOKENS, 2 * CHUNK_TOKENS, *extra)
    assert len(s.chunks) == len(s.bounds) - 1 == 2 + len(extra)
    assert s.tail_start == s.bounds[-1] == extra[-1]
    assert through_json(describe(s))["bounds"] == list(s.bounds)
    # every piece holds exactly its range's token ids and KV; the pieces are most of the file
    tokens = read_tokens(sf)
    for (a, b), piece in zip(itertools.pairwise(s.bounds), s.chunks, strict=True):
        parts = unpack_parts(piece.data, "chunk")
        assert list(struct.unpack(f"<{b - a}i", parts[0])) == tokens[a:b]
        assert len(piece.data) - 8 - 8 * len(parts) == (b - a) * s.layout.bytes_per_token()
        assert piece.crc32 == zlib.crc32(piece.data)
    assert all(b - a == CHUNK_TOKENS for a, b in itertools.pairwise(s.bounds[:3]))  # grid: whole cells
    # the tail's KV is that of the tokens after the last piece
    tail_kv = unpack_parts(bytes(unpack_parts(s.tail.data, "tail")[0]), "tail cells")
    n_tail = sf.n_tokens - s.tail_start
    assert list(struct.unpack(f"<{n_tail}i", tail_kv[0])) == tokens[s.tail_start :]
    assert len(s.tail.data) < len(data) // 2


def test_kv_bounds() -> None:
    """The grid of whole cells, then every checkpoint strictly inside the last partial cell, sorted
    and once each; checkpoints in earlier cells, on the grid, at or past the end are not bounds."""
    assert kv_bounds(605, [], 256) == [0, 256, 512]
    assert kv_bounds(605, [30, 256, 300, 602, 512, 540, 602, 605, 700, -1], 256) == [0, 256, 512, 540, 602]
    assert kv_bounds(512, [300, 500, 512, 513], 256) == [0, 256, 512]  # no partial cell
    assert kv_bounds(100, [50, 20, 50, 0, 100], 256) == [0, 20, 50]  # no whole cell
    assert kv_bounds(0, [0, 1], 256) == [0]
    assert kv_bounds(1, [0, 1], 256) == [0]
    assert kv_bounds(10, [9, 1, 5], 4) == [0, 4, 8, 9]


def _running_digest(ns: str, tokens: list[int], p: int, c: int) -> bytes:
    """The running digest of the first ``p`` tokens, computed from its definition: SHA-256 chained
    over whole cells from the namespace, then over the rest of the cell up to ``p``."""
    h = hashlib.sha256(ns.encode()).digest()
    for k in range(p // c):
        h = hashlib.sha256(h + struct.pack(f"<{c}i", *tokens[k * c : (k + 1) * c])).digest()
    if p % c:
        h = hashlib.sha256(h + struct.pack(f"<{p % c}i", *tokens[p - p % c : p])).digest()
    return h


@pytest.mark.parametrize("chunk_tokens", [CHUNK_TOKENS, 100])
def test_piece_names_are_range_digests(files: dict[str, Files], chunk_tokens: int) -> None:
    """Every KV piece, grid or not, is named sha256("kv" + running digest of the tokens up to its
    end + its start as 8 little-endian bytes), and its CRC."""
    _, sf, s = load(files["qwen35"].g2, chunk_tokens=chunk_tokens)
    tokens = read_tokens(sf)
    arr = np.array(tokens, dtype="<i4")
    heads = chain(s.ns, arr, chunk_tokens, sf.n_tokens // chunk_tokens)
    assert len(s.bounds) - 1 > sf.n_tokens // chunk_tokens  # some pieces end at checkpoints
    for (a, b), piece in zip(itertools.pairwise(s.bounds), s.chunks, strict=True):
        running = _running_digest(s.ns, tokens, b, chunk_tokens)
        assert prefix_digest(heads, arr, b, chunk_tokens) == running
        expected = hashlib.sha256(b"kv" + running + a.to_bytes(8, "little")).hexdigest()
        assert piece.digest == range_digest(heads, arr, a, b, chunk_tokens) == expected
        assert piece.name == f"{expected}-{zlib.crc32(piece.data):08x}"
    # where a piece begins is part of its name: the same end from another start is another piece
    a, b = s.bounds[-2], s.bounds[-1]
    assert range_digest(heads, arr, a, b, chunk_tokens) != range_digest(heads, arr, a + 1, b, chunk_tokens)


def test_recurrent_model_keeps_its_state_in_the_tail(files: dict[str, Files]) -> None:
    data, sf, s = load(files["mamba2"].g1)
    assert s.layout is None and s.chunks == ()
    assert s.bounds == (0,) and s.tail_start == 0  # checkpoints in the last cell cut nothing here
    assert last_cell_checkpoints(sf)
    assert describe(s)["layout"] is None
    assert len(s.checkpoints) == len(sf.checkpoints) > 0
    assert len(s.tail.data) >= sf.state_len


@pytest.mark.parametrize("chunk_tokens", [64, 100, 1000])
def test_other_chunk_sizes_round_trip(files: dict[str, Files], chunk_tokens: int) -> None:
    data, sf, s = load(files["qwen35"].g2, chunk_tokens=chunk_tokens)
    whole = sf.n_tokens // chunk_tokens
    extra = last_cell_checkpoints(sf, chunk_tokens)
    assert s.bounds == (*range(0, whole * chunk_tokens + 1, chunk_tokens), *extra)
    assert len(s.chunks) == whole + len(extra) and extra  # qwen35 checkpoints every 64 tokens
    assert assemble_bytes(through_json(describe(s)), objects_of(s)) == data


@pytest.mark.parametrize("damage", ["shifted-cell", "two-sequences", "two-streams"])
def test_unchunkable_kv_layouts_fall_back_to_the_tail(
    files: dict[str, Files], slot_writer: Any, tmp_path: Path, damage: str
) -> None:
    """A cache whose cells are not one sequence at positions 0..n-1 in one stream (a shifted
    context, say) is not chunked, and still comes back byte for byte."""
    data, sf, s = load(files["llama"].g1)
    assert s.layout is not None
    cell_3 = sf.state_offset + 8 + 3 * s.layout.cell_bytes
    field = {
        "shifted-cell": (cell_3, 1000),
        "two-sequences": (cell_3 + 8, 1),
        "two-streams": (sf.state_offset, 2),
    }
    patched = bytearray(data)
    struct.pack_into("<i", patched, *field[damage])
    (tmp_path / "x.slot").write_bytes(slot_writer.refix(patched))
    patched_data, _, s2 = load(tmp_path / "x.slot")
    assert s2.layout is None and s2.chunks == ()
    assert assemble_bytes(through_json(describe(s2)), objects_of(s2)) == patched_data


def test_parse_kv_needs_known_types_and_an_attention_cache(files: dict[str, Files]) -> None:
    _, sf, s = load(files["llama"].g1)
    state = memoryview(files["llama"].g1.read_bytes())[sf.state_offset : sf.base_len]
    assert chunking.parse_kv(state, sf.n_tokens, sf.meta) == s.layout
    context, model = sf.meta["context"], sf.meta["model"]
    for meta in (
        {**sf.meta, "context": {**context, "type_k": "q9_9"}},
        {**sf.meta, "context": {**context, "type_v": None}},
        {**sf.meta, "model": {**model, "recurrent": True, "hybrid": False}},
        {**sf.meta, "model": {**model, "n_layer": 1}},  # fewer layers than the cache holds
        {k: v for k, v in sf.meta.items() if k != "context"},
    ):
        assert chunking.parse_kv(state, sf.n_tokens, meta) is None
    assert chunking.parse_kv(state, sf.n_tokens - 1, sf.meta) is None
    assert chunking.parse_kv(state[:100], sf.n_tokens, sf.meta) is None
    assert chunking.parse_kv(state[: len(state) // 2], sf.n_tokens, sf.meta) is None


# --------------------------------------------------------------------------------------- sharing
@pytest.mark.parametrize("arch", ["qwen35", "llama", "gemma2", "lfm2", "llama-fa"])
def test_a_growing_session_shares_its_leading_chunks(files: dict[str, Files], arch: str) -> None:
    _, sf1, s1 = load(files[arch].g1)
    _, sf2, s2 = load(files[arch].g2)
    assert sf2.n_tokens > sf1.n_tokens
    assert s1.ns == s2.ns
    # same 512 tokens, same whole-cell pieces
    assert s1.bounds[:3] == s2.bounds[:3] == (0, CHUNK_TOKENS, 2 * CHUNK_TOKENS)
    assert [p.name for p in s1.chunks[:2]] == [p.name for p in s2.chunks[:2]]
    # g2 grew inside g1's last partial cell and kept g1's checkpoints there: g1's pieces cut at
    # them are g2's leading pieces too; only what follows g1's last checkpoint is new
    assert s2.bounds[: len(s1.bounds)] == s1.bounds and len(s2.bounds) > len(s1.bounds)
    assert [p.name for p in s2.chunks[: len(s1.chunks)]] == [p.name for p in s1.chunks]
    # checkpoints of the same prefix are the same piece (the stored ladder is bounded: the longer
    # session may keep other positions than the shorter did, native/DESIGN.md); the newest is new
    ck1 = {n: p.name for n, p in s1.checkpoints}
    ck2 = {n: p.name for n, p in s2.checkpoints}
    shared = ck1.keys() & ck2.keys()
    assert shared and all(ck1[n] == ck2[n] for n in shared)
    assert max(ck2) > max(ck1) and ck2[max(ck2)] not in ck1.values()
    # the tails differ (they hold the tokens after the last whole chunk)
    assert s1.tail.data != s2.tail.data


@pytest.mark.parametrize("arch", ["qwen35", "llama"])
def test_a_session_restored_into_another_slot_shares_its_chunks(files: dict[str, Files], arch: str) -> None:
    """The engine pool restores a session into whichever slot is free: its next save should still
    find its leading chunks stored (llama.cpp discards the saved seq_id on load)."""
    _, sf1, s1 = load(files[arch].g1)
    _, sfm, sm = load(files[arch].moved)
    assert read_tokens(sfm)[: sf1.n_tokens] == read_tokens(sf1)
    assert (s1.seq_id, sm.seq_id) == (0, 1)  # really saved from another slot
    assert sm.bounds[: len(s1.bounds)] == s1.bounds  # g1's pieces, then the new turn's
    assert [p.name for p in sm.chunks[: len(s1.chunks)]] == [p.name for p in s1.chunks]


@pytest.mark.parametrize("arch", ["qwen35", "llama", "mamba2"])
def test_the_same_tokens_from_another_slot_are_the_same_pieces(files: dict[str, Files], arch: str) -> None:
    """``g2`` (slot 0) and ``moved`` (slot 1) hold the same tokens: every chunk and checkpoint is
    one piece, checkpoints captured in either slot included; only the plans' sequence ids differ,
    and each plan assembles its own file."""
    data2, sf2, s2 = load(files[arch].g2)
    datam, sfm, sm = load(files[arch].moved)
    assert read_tokens(sf2) == read_tokens(sfm)
    assert sm.bounds == s2.bounds and [p.name for p in sm.chunks] == [p.name for p in s2.chunks]
    if arch == "mamba2":
        assert sm.chunks == () and sm.bounds == (0,)
    else:  # two whole cells, then the pieces cut at the checkpoints inside the last one
        assert sm.bounds == (0, CHUNK_TOKENS, 2 * CHUNK_TOKENS, *last_cell_checkpoints(sfm))
        assert len(sm.chunks) > 2
    assert [(n, p.name) for n, p in sm.checkpoints] == [(n, p.name) for n, p in s2.checkpoints]
    assert 1 in (sm.seq_id, *sm.ckpt_seq_ids) and 1 not in (s2.seq_id, *s2.ckpt_seq_ids)
    shared = objects_of(s2) | {sm.tail.name: sm.tail.data}
    assert assemble_bytes(through_json(describe(sm)), shared) == datam
    assert assemble_bytes(through_json(describe(s2)), objects_of(s2)) == data2


def test_pieces_carry_no_sequence_id_and_the_plan_does(files: dict[str, Files]) -> None:
    data, _, s = load(files["qwen35"].moved)
    assert s.layout is not None and s.seq_id == 1
    cb = s.layout.cell_bytes
    for piece in s.chunks:
        cells = unpack_parts(piece.data, "chunk")[1]
        records = [bytes(cells[i : i + cb]) for i in range(0, len(cells), cb)]
        assert records and all(r[-4:] == bytes(4) for r in records)
    magic = struct.pack("<I", 0xAF143CD8)
    for _, piece in s.checkpoints:
        entry = bytes(unpack_parts(piece.data, "checkpoint")[0])
        assert entry[24:28] == magic and entry[28:32] == bytes(4)
    plan = through_json(describe(s))
    assert plan["seq_id"] == 1
    assert [e[3] for e in plan["checkpoints"]] == list(s.ckpt_seq_ids) and s.ckpt_seq_ids[-1] == 1
    assert assemble_bytes(plan, objects_of(s)) == data
    # the plan's ids are what assembly writes: another id is another file
    for other in ({**plan, "seq_id": 0}, {**plan, "checkpoints": [[*e[:3], 0] for e in plan["checkpoints"]]}):
        size, crc = write_v1(None, other, objects_of(s))
        assert size == len(data) and crc != zlib.crc32(data)


def _as_first_written(s: Split) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The plan and objects of ``s`` as the first chunked release wrote them: cell records and
    checkpoint states kept their sequence id, plans had no ``seq_id`` and 3-element checkpoints."""
    seq = struct.pack("<i", s.seq_id)

    def with_seq(payload: bytes) -> bytes:
        assert s.layout is not None
        parts = [bytes(p) for p in unpack_parts(payload, "range")]
        cb = s.layout.cell_bytes
        parts[1] = b"".join(parts[1][i : i + cb - 4] + seq for i in range(0, len(parts[1]), cb))
        return pack_parts(parts)

    def named(digest: str, data: bytes) -> tuple[str, bytes]:
        return f"{digest}-{zlib.crc32(data):08x}", data

    plan: dict[str, Any] = through_json(describe(s))
    del plan["seq_id"]
    objects: dict[str, bytes] = {}
    plan["chunks"] = []
    for piece in s.chunks:
        name, data = named(piece.digest, with_seq(piece.data))
        objects[name] = data
        plan["chunks"].append([name, len(data)])
    plan["checkpoints"] = []
    for (n, piece), ck_seq in zip(s.checkpoints, s.ckpt_seq_ids, strict=True):
        parts = [bytes(p) for p in unpack_parts(piece.data, "checkpoint")]
        if parts[0][24:28] == struct.pack("<I", 0xAF143CD8):
            parts[0] = parts[0][:28] + struct.pack("<i", ck_seq) + parts[0][32:]
        name, data = named(piece.digest, pack_parts(parts))
        objects[name] = data
        plan["checkpoints"].append([n, name, len(data)])
    tail = [bytes(p) for p in unpack_parts(s.tail.data, "tail")]
    if s.layout is not None:
        tail[0] = with_seq(tail[0])
    name, data = named(s.tail.digest, pack_parts(tail))
    objects[name] = data
    plan["tail"] = [name, len(data)]
    return plan, objects


@pytest.mark.parametrize("which", ["g1", "moved"])
@pytest.mark.parametrize("arch", ["qwen35", "llama", "mamba2"])
def test_manifests_of_the_first_chunked_release_still_assemble(
    files: dict[str, Files], arch: str, which: str
) -> None:
    """Manifests written before pieces dropped their sequence id have no ``seq_id`` and 3-element
    checkpoint entries, and their pieces hold the saving slot's id: they still restore."""
    data, _, s = load(getattr(files[arch], which))
    plan, objects = _as_first_written(s)
    assert all(len(e) == 3 for e in plan["checkpoints"]) and "seq_id" not in plan
    assert write_v1(None, plan, objects) == (len(data), zlib.crc32(data))


@pytest.mark.parametrize("arch", ["qwen35", "llama", "gemma2", "lfm2"])
def test_a_fork_shares_the_common_prefix_and_differs_after(files: dict[str, Files], arch: str) -> None:
    _, sf1, s1 = load(files[arch].g1)
    _, sfk, sk = load(files[arch].fork)
    assert read_tokens(sf1)[:300] == read_tokens(sfk)[:300] and read_tokens(sf1)[300] != read_tokens(sfk)[300]
    assert sk.bounds[:2] == (0, CHUNK_TOKENS) and sfk.n_tokens < 2 * CHUNK_TOKENS
    assert sk.bounds == (0, CHUNK_TOKENS, *last_cell_checkpoints(sfk))
    assert sk.chunks[0].name == s1.chunks[0].name  # tokens [0, 256) agree
    # the fork diverges at 300, not at a checkpoint: none of its pieces past [0, 256) is g1's
    # (g1's second cell is one whole piece, the fork's cuts it at its own checkpoints)
    assert {p.name for p in sk.chunks[1:]}.isdisjoint({p.name for p in s1.chunks})
    assert s1.chunks[1].name not in {p.name for p in sk.chunks}
    shared = {n for n, _ in s1.checkpoints} & {n for n, _ in sk.checkpoints}
    for n in shared:
        same = dict(s1.checkpoints)[n].name == dict(sk.checkpoints)[n].name
        assert same == (n <= 300), n  # a checkpoint inside the common prefix is shared, none after


@pytest.mark.parametrize("arch", ["qwen35", "llama", "gemma2", "lfm2", "llama-fa"])
def test_a_fork_at_a_checkpoint_shares_the_piece_ending_there(files: dict[str, Files], arch: str) -> None:
    """``branch`` keeps g1's tokens up to g1's last checkpoint — inside g1's last partial cell — and
    goes on with other text (a regenerated answer, the next turn after an edit): every piece up to
    that checkpoint is g1's, the one ending at it included (the same name, so a store keeps one
    copy); only the KV after it is the branch's own."""
    _, sf1, s1 = load(files[arch].g1)
    datab, sfb, sb = load(files[arch].branch)
    cut = last_cell_checkpoints(sf1)[-1]
    t1, tb = read_tokens(sf1), read_tokens(sfb)
    assert tb[:cut] == t1[:cut] and tb[: sf1.n_tokens] != t1[: sfb.n_tokens]
    assert cut in {c.n_tokens for c in sfb.checkpoints}  # the engine kept it: the fork's bound too
    assert sfb.n_tokens // CHUNK_TOKENS == sf1.n_tokens // CHUNK_TOKENS == 2  # inside g1's last cell
    i = s1.bounds.index(cut)
    assert s1.bounds[i - 1] >= 2 * CHUNK_TOKENS  # the piece ending at cut lies in the last cell
    assert sb.bounds[: i + 1] == s1.bounds[: i + 1]
    assert [p.name for p in sb.chunks[:i]] == [p.name for p in s1.chunks[:i]]
    assert sb.chunks[i - 1].name == s1.chunks[i - 1].name and sb.chunks[i - 1].data == s1.chunks[i - 1].data
    # after the divergence: the branch's own pieces (cut at its own checkpoints) and tail
    assert sb.bounds[i + 1 :] == tuple(c for c in last_cell_checkpoints(sfb) if c > cut)
    assert {p.name for p in sb.chunks[i:]}.isdisjoint({p.name for p in s1.chunks})
    # the checkpoint at the divergence is shared too, and the branch assembles from g1's pieces
    # up to it plus its own
    assert dict(sb.checkpoints)[cut].name == dict(s1.checkpoints)[cut].name
    own = {p.name: p.data for p in sb.chunks[i:]} | {sb.tail.name: sb.tail.data}
    own |= {p.name: p.data for n, p in sb.checkpoints if n != cut}
    assert assemble_bytes(through_json(describe(sb)), objects_of(s1) | own) == datab


def test_pieces_depend_on_the_scope(files: dict[str, Files]) -> None:
    data, sf, a = load(files["qwen35"].g1, scope="acme")
    _, _, b = load(files["qwen35"].g1, scope="globex")
    _, _, a2 = load(files["qwen35"].g1, scope="acme")
    assert a.ns != b.ns and a.ns == a2.ns
    assert a.bounds == b.bounds and len(a.chunks) > 2  # the same cuts, extra pieces included
    assert [p.name for p in a.chunks] == [p.name for p in a2.chunks]
    names_a = {p.name for p in a.chunks} | {p.name for _, p in a.checkpoints} | {a.tail.name}
    names_b = {p.name for p in b.chunks} | {p.name for _, p in b.checkpoints} | {b.tail.name}
    assert names_a.isdisjoint(names_b)
    assert [p.data for p in a.chunks] == [p.data for p in b.chunks]  # same bytes, other names
    assert assemble_bytes(describe(b), objects_of(b)) == data


def test_pieces_depend_on_the_model_and_context_shape(files: dict[str, Files]) -> None:
    data, sf, s = load(files["qwen35"].g1)
    base = chunking.namespace(sf.fingerprint or "", sf.meta, s.layout, sf.state_version, "acme")
    assert base == s.ns
    other_model = chunking.namespace("cd" * 32, sf.meta, s.layout, sf.state_version, "acme")
    ctx = {**sf.meta["context"], "type_k": "q8_0"}
    other_types = chunking.namespace(
        sf.fingerprint or "", {**sf.meta, "context": ctx}, s.layout, sf.state_version, "acme"
    )
    other_version = chunking.namespace(sf.fingerprint or "", sf.meta, s.layout, sf.state_version + 1, "acme")
    assert len({base, other_model, other_types, other_version}) == 4
    # n_slots is informative only (SLOTFILE.md): it does not change the namespace
    informative = {**sf.meta["context"], "n_slots": 7}
    assert (
        chunking.namespace(
            sf.fingerprint or "", {**sf.meta, "context": informative}, s.layout, sf.state_version, "acme"
        )
        == base
    )


# --------------------------------------------------------------------------- pieces that do not fit
def _raises_slot_file_error(plan: Any, objects: Any, *, checksum: bool = True) -> SlotFileError:
    with pytest.raises(SlotFileError) as info:
        write_v1(None, plan, objects, checksum=checksum)
    return info.value


def _fits_or_slot_file_error(plan: Any, objects: Any, original: bytes) -> None:
    """write_v1 either refuses with SlotFileError or writes something whose CRC the caller checks
    (a plan value that still parses, e.g. 1.5 for 1): any other exception is a bug."""
    try:
        size, crc = write_v1(None, plan, objects)
    except SlotFileError:
        return
    if (size, crc) == (len(original), zlib.crc32(original)):
        return  # the damage did not change the file (an ignored or equivalent value)


@pytest.mark.parametrize("arch", ["qwen35", "llama-fa", "mamba2"])
def test_missing_pieces_are_refused(files: dict[str, Files], arch: str) -> None:
    _, _, s = load(files[arch].g1)
    plan, objects = describe(s), objects_of(s)
    for name in objects:
        rest = {k: v for k, v in objects.items() if k != name}
        _raises_slot_file_error(plan, rest)


@pytest.mark.parametrize("arch", ["qwen35", "llama-fa", "mamba2"])
def test_truncated_and_extended_pieces_are_refused(files: dict[str, Files], arch: str) -> None:
    _, _, s = load(files[arch].g1)
    plan, objects = describe(s), objects_of(s)
    for name, data in objects.items():
        for bad in (data[:-1], data + b"\0", data[:7], b"", data[: len(data) // 2]):
            err = _raises_slot_file_error(plan, {**objects, name: bad})
            assert err.kind in ("truncated", "bad_magic", "bad_layout")


def test_pieces_of_another_file_are_refused(files: dict[str, Files]) -> None:
    """Objects under the right names but from another model's file (other layer count, V layout)."""
    _, _, q = load(files["qwen35"].g1)
    _, _, f = load(files["llama-fa"].g1)
    plan = describe(q)
    for qp, fp in zip(q.chunks, f.chunks, strict=True):
        _raises_slot_file_error(plan, {**objects_of(q), qp.name: fp.data})
    _raises_slot_file_error(plan, {**objects_of(q), q.tail.name: f.tail.data})
    # the plan of a recurrent file over an attention model's tail: the tokens do not match
    _, _, m = load(files["mamba2"].g1)
    _raises_slot_file_error(describe(m), {**objects_of(m), m.tail.name: q.tail.data})


def test_pieces_reordered_within_a_plan_are_caught_by_the_crc(files: dict[str, Files]) -> None:
    """Chunks of the same shape (two whole cells) swapped: write_v1 cannot tell, the whole-file CRC
    does."""
    data, _, s = load(files["qwen35"].g1)
    a, b = s.chunks[:2]
    assert s.bounds[:3] == (0, CHUNK_TOKENS, 2 * CHUNK_TOKENS)
    swapped = {**objects_of(s), a.name: b.data, b.name: a.data}
    size, crc = write_v1(None, describe(s), swapped)
    assert size == len(data) and crc != zlib.crc32(data)


_BAD_VALUES: list[Any] = [None, -1, 2**70, "x", [], {}, 1.5, float("nan"), [[]], ["x", 1], True]
_PLAN_FIELDS = ["n_tokens", "state_version", "layout", "chunks", "checkpoints", "tail", "records"]


@pytest.mark.parametrize("arch", ["qwen35", "llama-fa", "mamba2"])
@pytest.mark.parametrize("field", _PLAN_FIELDS)
def test_malformed_plans_raise_only_slot_file_error(files: dict[str, Files], arch: str, field: str) -> None:
    data, _, s = load(files[arch].g1)
    plan, objects = through_json(describe(s)), objects_of(s)
    for bad in _BAD_VALUES:
        _fits_or_slot_file_error({**plan, field: bad}, objects, data)
    broken = copy.deepcopy(plan)
    del broken[field]
    _fits_or_slot_file_error(broken, objects, data)


@pytest.mark.parametrize("where", ["n_tokens", "state_version", "layout.cell_bytes", "layout.v_trans"])
def test_infinite_numbers_in_a_plan_raise_slot_file_error(files: dict[str, Files], where: str) -> None:
    """A manifest is JSON, and Python's json reads ``Infinity`` and ``1e999`` as float infinity."""
    data, _, s = load(files["qwen35"].g1)
    raw = json.dumps(describe(s))
    plan = json.loads(raw)
    if where.startswith("layout."):
        plan["layout"][where.split(".")[1]] = json.loads("1e999")
    else:
        plan[where] = json.loads("Infinity")
    _fits_or_slot_file_error(plan, objects_of(s), data)


@pytest.mark.parametrize("arch", ["qwen35", "llama-fa"])
def test_malformed_layouts_raise_only_slot_file_error(files: dict[str, Files], arch: str) -> None:
    data, _, s = load(files[arch].g1)
    plan, objects = through_json(describe(s)), objects_of(s)
    for key in ("cell_bytes", "v_trans", "k", "v"):
        for bad in _BAD_VALUES:
            _fits_or_slot_file_error({**plan, "layout": {**plan["layout"], key: bad}}, objects, data)
    for key, row in (
        ("k", [[1, 0]]),
        ("k", [[1, -5]]),
        ("v", [[1, 2, 0]]),
        ("v", [[1, 2, -1]]),
        ("v", [[1, 2, 1 << 40]]),
        ("k", []),
        ("v", []),
    ):
        _fits_or_slot_file_error({**plan, "layout": {**plan["layout"], key: row}}, objects, data)


def test_malformed_records_raise_only_slot_file_error(files: dict[str, Files]) -> None:
    _, _, s = load(files["qwen35"].g1)
    plan, objects = through_json(describe(s)), objects_of(s)
    for bad in (["t99"], ["c99"], ["z0"], [""], ["t"], ["tx"], [7], [None]):
        _raises_slot_file_error({**plan, "records": bad}, objects)


def _mutations(data: bytes, rng: random.Random) -> list[bytes]:
    """Damage concentrated where lengths and counts live: the head of every part table."""
    out = []
    for _ in range(24):
        b = bytearray(data)
        pos = rng.randrange(min(len(b), 96)) if rng.random() < 0.7 else rng.randrange(len(b))
        b[pos] ^= 1 << rng.randrange(8)
        out.append(bytes(b))
    for value in (0, 1, 0xFFFFFFFF, 0x7FFFFFFF):
        b = bytearray(data)
        struct.pack_into("<I", b, 4, value)  # the part count
        out.append(bytes(b))
    return [m for m in out if m != data]  # (a part count set to what it is damages nothing)


def _part_offsets(data: bytes) -> list[int]:
    """Where each part of a :func:`pack_parts` blob begins inside it."""
    parts = unpack_parts(data, "x")
    out, pos = [], 8 + 8 * len(parts)
    for part in parts:
        out.append(pos)
        pos += len(part)
    return out


def _unread_bytes(s: Split) -> dict[str, set[int]]:
    """Per object, the offsets assembly overwrites with the plan's values: the zeroed sequence id
    of every cell record (in KV pieces and in the tail's cells) and of each checkpoint's state."""
    out: dict[str, set[int]] = {}

    def cell_seq_ids(blob: bytes, base: int) -> set[int]:
        assert s.layout is not None
        cb, start = s.layout.cell_bytes, _part_offsets(blob)[1]
        n_cells = len(unpack_parts(blob, "range")[1]) // cb
        return {base + start + i * cb + j for i in range(n_cells) for j in range(cb - 4, cb)}

    for _, piece in s.checkpoints:
        head = _part_offsets(piece.data)[0]
        out[piece.name] = set(range(head + 28, head + 32))
    if s.layout is not None:
        for piece in s.chunks:
            out[piece.name] = cell_seq_ids(piece.data, 0)
        tail_cells = _part_offsets(s.tail.data)[0]
        end = tail_cells + len(unpack_parts(s.tail.data, "tail")[0])
        out[s.tail.name] = cell_seq_ids(s.tail.data[tail_cells:end], tail_cells)
    return out


@pytest.mark.parametrize("arch", ["qwen35", "llama-fa", "mamba2"])
def test_damaged_pieces_never_raise_anything_but_slot_file_error(files: dict[str, Files], arch: str) -> None:
    data, _, s = load(files[arch].g1)
    plan, objects = describe(s), objects_of(s)
    rng = random.Random(arch)
    unread = _unread_bytes(s)
    for name in objects:
        for bad in _mutations(objects[name], rng):
            try:
                size, crc = write_v1(None, plan, {**objects, name: bad})
            except SlotFileError:
                continue
            if (size, crc) != (len(data), zlib.crc32(data)):
                continue  # a damage that fits shows in the CRC
            # ... unless it only touched bytes assembly does not read: a zeroed sequence id (of a
            # cell record or a checkpoint's state: the plan's is written there; small pieces cut
            # at checkpoints put cell records within reach of the damage), and then the file is
            # the original
            changed = {i for i, (x, y) in enumerate(zip(objects[name], bad, strict=True)) if x != y}
            assert changed and changed <= unread.get(name, set()), (name, sorted(changed))
            assert assemble_bytes(plan, {**objects, name: bad}) == data


def test_sequence_ids_in_pieces_are_not_read(files: dict[str, Files]) -> None:
    """What the test above allows, shown on every object: any value in the zeroed sequence-id
    bytes assembles the original file (the plan's ids are written there)."""
    data, _, s = load(files["qwen35"].moved)
    plan, objects = describe(s), objects_of(s)
    unread = _unread_bytes(s)
    assert set(unread) == set(objects)
    for name, offsets in unread.items():
        bad = bytearray(objects[name])
        for i in offsets:
            bad[i] ^= 0x5A
        assert assemble_bytes(plan, {**objects, name: bytes(bad)}) == data, name


# ------------------------------------------------------------------------------------ parts framing
def test_parts_round_trip() -> None:
    for parts in ([], [b""], [b"a"], [b"abc", b"", b"\0" * 1000]):
        packed = pack_parts(parts)
        assert [bytes(p) for p in unpack_parts(packed, "x")] == parts


def test_unpack_parts_bounds() -> None:
    good = pack_parts([b"abc", b"de"])
    cases = {
        "short": good[:7],
        "no header": b"",
        "bad magic": b"XKPT" + good[4:],
        "truncated table": good[: 8 + 8],
        "truncated data": good[:-1],
        "trailing bytes": good + b"!",
        "huge count": good[:4] + struct.pack("<I", 0xFFFFFFFF) + good[8:],
        "count over the limit": b"SKPT" + struct.pack("<I", (1 << 16) + 1) + b"\0" * (8 * ((1 << 16) + 1)),
        "count too high": good[:4] + struct.pack("<I", 3) + good[8:],
        "huge length": good[:8] + struct.pack("<Q", 2**64 - 1) + good[16:],
        "length past the end": good[:8] + struct.pack("<Q", 6) + good[16:],
    }
    kinds = {}
    for what, data in cases.items():
        with pytest.raises(SlotFileError) as info:
            unpack_parts(data, what)
        kinds[what] = info.value.kind
        assert what in str(info.value)
    assert kinds["bad magic"] == kinds["short"] == "bad_magic"
    assert kinds["huge count"] == kinds["huge length"] == kinds["truncated data"] == "truncated"
    assert kinds["trailing bytes"] == "bad_layout"
    # the limit itself is allowed
    at_limit = b"SKPT" + struct.pack("<I", 1 << 16) + b"\0" * (8 * (1 << 16))
    assert len(unpack_parts(at_limit, "x")) == 1 << 16

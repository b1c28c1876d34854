"""storage.chunking against slot files written by the real native engine: pieces assemble back
byte for byte, growing and forked sessions share their leading pieces, and pieces that do not fit
their plan are refused with SlotFileError (never another exception)."""

from __future__ import annotations

import copy
import json
import random
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import native
from storage import chunking
from storage.chunking import (
    CHUNK_TOKENS,
    Split,
    assemble_bytes,
    describe,
    pack_parts,
    split,
    unpack_parts,
    write_v1,
)
from storage.errors import SlotFileError
from storage.slotfile import SlotFile, read_slot_file, read_tokens, verify_slot_file

ARCHS = ["qwen35", "llama", "gemma2", "mamba2", "lfm2"]


@dataclass(frozen=True)
class Files:
    """One engine's slot files: ``g1`` (> 2 chunks) saved from slot 0, ``g2`` (``g1`` plus a few
    tokens, same slot), ``moved`` (``g1`` restored into slot 1, then the same few tokens) and
    ``fork`` (slot 0 again: the first 300 prompt tokens of ``g1``, then other text)."""

    g1: Path
    g2: Path
    moved: Path
    fork: Path


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
    return Files(*(folder / f"{name}.slot" for name in ("g1", "g2", "moved", "fork")))


@pytest.fixture(scope="module")
def files(tiny_model: Callable[..., str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Files]:
    """Per architecture (and ``llama-fa``: flash attention, so V is not transposed)."""
    root = tmp_path_factory.mktemp("chunking")
    out = {arch: make_files(tiny_model(arch), root / arch) for arch in ARCHS}
    out["llama-fa"] = make_files(tiny_model("llama"), root / "llama-fa", flash_attn=True)
    return out


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


# ------------------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("arch", [*ARCHS, "llama-fa"])
@pytest.mark.parametrize("which", ["g1", "g2", "moved", "fork"])
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


@pytest.mark.parametrize(
    ("arch", "cell_bytes", "v_trans"),
    [("qwen35", 24, 1), ("llama", 12, 1), ("gemma2", 12, 1), ("lfm2", 12, 1), ("llama-fa", 12, 0)],
)
def test_attention_kv_is_chunked(files: dict[str, Files], arch: str, cell_bytes: int, v_trans: int) -> None:
    data, sf, s = load(files[arch].g1)
    assert s.layout is not None
    assert (s.layout.cell_bytes, s.layout.v_trans) == (cell_bytes, v_trans)
    assert len(s.chunks) == sf.n_tokens // CHUNK_TOKENS == 2
    assert s.tail_start == 2 * CHUNK_TOKENS
    # every chunk holds exactly its 256 tokens' ids and KV; the chunks are most of the file
    for k, piece in enumerate(s.chunks):
        parts = unpack_parts(piece.data, "chunk")
        ids = struct.unpack(f"<{CHUNK_TOKENS}i", parts[0])
        assert list(ids) == read_tokens(sf)[k * CHUNK_TOKENS : (k + 1) * CHUNK_TOKENS]
        assert len(piece.data) - 8 - 8 * len(parts) == CHUNK_TOKENS * s.layout.bytes_per_token()
        assert piece.crc32 == zlib.crc32(piece.data)
    assert len(s.tail.data) < len(data) // 2


def test_recurrent_model_keeps_its_state_in_the_tail(files: dict[str, Files]) -> None:
    data, sf, s = load(files["mamba2"].g1)
    assert s.layout is None and s.chunks == ()
    assert describe(s)["layout"] is None
    assert len(s.checkpoints) == len(sf.checkpoints) > 0
    assert len(s.tail.data) >= sf.state_len


@pytest.mark.parametrize("chunk_tokens", [64, 100, 1000])
def test_other_chunk_sizes_round_trip(files: dict[str, Files], chunk_tokens: int) -> None:
    data, sf, s = load(files["qwen35"].g2, chunk_tokens=chunk_tokens)
    assert len(s.chunks) == sf.n_tokens // chunk_tokens
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
    assert [p.name for p in s1.chunks] == [p.name for p in s2.chunks]  # same 512 tokens, same pieces
    assert s1.ns == s2.ns
    # checkpoints of the same prefix are the same piece; the new one is new
    ck1 = {n: p.name for n, p in s1.checkpoints}
    ck2 = {n: p.name for n, p in s2.checkpoints}
    assert ck1.items() <= ck2.items() and len(ck2) > len(ck1)
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
    assert [p.name for p in sm.chunks] == [p.name for p in s1.chunks]


@pytest.mark.parametrize("arch", ["qwen35", "llama", "mamba2"])
def test_the_same_tokens_from_another_slot_are_the_same_pieces(files: dict[str, Files], arch: str) -> None:
    """``g2`` (slot 0) and ``moved`` (slot 1) hold the same tokens: every chunk and checkpoint is
    one piece, checkpoints captured in either slot included; only the plans' sequence ids differ,
    and each plan assembles its own file."""
    data2, sf2, s2 = load(files[arch].g2)
    datam, sfm, sm = load(files[arch].moved)
    assert read_tokens(sf2) == read_tokens(sfm)
    assert [p.name for p in sm.chunks] == [p.name for p in s2.chunks]
    assert len(sm.chunks) == (0 if arch == "mamba2" else 2)
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
    assert len(sk.chunks) == 1 and len(s1.chunks) == 2
    assert sk.chunks[0].name == s1.chunks[0].name  # tokens [0, 256) agree
    assert s1.chunks[1].name not in {p.name for p in sk.chunks}
    shared = {n for n, _ in s1.checkpoints} & {n for n, _ in sk.checkpoints}
    for n in shared:
        same = dict(s1.checkpoints)[n].name == dict(sk.checkpoints)[n].name
        assert same == (n <= 300), n  # a checkpoint inside the common prefix is shared, none after


def test_pieces_depend_on_the_scope(files: dict[str, Files]) -> None:
    data, sf, a = load(files["qwen35"].g1, scope="acme")
    _, _, b = load(files["qwen35"].g1, scope="globex")
    _, _, a2 = load(files["qwen35"].g1, scope="acme")
    assert a.ns != b.ns and a.ns == a2.ns
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
def _raises_slot_file_error(plan: Any, objects: Any) -> SlotFileError:
    with pytest.raises(SlotFileError) as info:
        write_v1(None, plan, objects)
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
    """Chunks of the same shape swapped: write_v1 cannot tell, the whole-file CRC does."""
    data, _, s = load(files["qwen35"].g1)
    a, b = s.chunks
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
    return out


@pytest.mark.parametrize("arch", ["qwen35", "llama-fa", "mamba2"])
def test_damaged_pieces_never_raise_anything_but_slot_file_error(files: dict[str, Files], arch: str) -> None:
    data, _, s = load(files[arch].g1)
    plan, objects = describe(s), objects_of(s)
    rng = random.Random(arch)
    checkpoints = {p.name for _, p in s.checkpoints}
    for name in objects:
        for bad in _mutations(objects[name], rng):
            try:
                size, crc = write_v1(None, plan, {**objects, name: bad})
            except SlotFileError:
                continue
            if (size, crc) != (len(data), zlib.crc32(data)):
                continue  # a damage that fits shows in the CRC
            # ... unless it only touched bytes assembly does not read: a checkpoint's zeroed
            # sequence id (the plan's is written there), and then the file is the original
            assert name in checkpoints, name
            head = 8 + 8 * len(unpack_parts(objects[name], "checkpoint"))
            changed = [i for i, (x, y) in enumerate(zip(objects[name], bad, strict=True)) if x != y]
            assert changed and all(head + 28 <= i < head + 32 for i in changed), changed
            assert assemble_bytes(plan, {**objects, name: bad}) == data


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

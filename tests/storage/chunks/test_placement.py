"""storage.chunks.placement and storage.chunks.assembly.PlacedFile against slot files written by the
real native engine: pieces written one by one into their places, in any order and from several
threads, give back the file write_v1 writes from every piece at once — byte for byte, for every
tiny architecture and both V layouts — and plans or pieces that do not fit are refused with
SlotFileError, damage in a piece named as ChecksumError, never another exception."""

from __future__ import annotations

import copy
import json
import random
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from support.chunk_files import ARCHS, Files, load, objects_of, through_json

from storage.chunks import assembly
from storage.chunks.assembly import PlacedFile
from storage.chunks.chunking import describe, unpack_parts, write_v1
from storage.chunks.placement import kv_placement
from storage.errors import ChecksumError, SlotFileError
from storage.slotfile.reader import read_slot_file


def placed(
    plan: dict[str, Any],
    objects: dict[str, bytes],
    path: Path,
    *,
    window: int = 0,
    order: int = 0,
    verify: bool = False,
) -> tuple[int, int]:
    """The file ``plan`` describes written at ``path`` as a restore writes it: the chunks in windows
    of ``window`` pieces (0: all in one), the windows in an order shuffled by ``order``, the tail's
    cells with the last window; the rest before them or after (by ``order``); (size, CRC or 0)."""
    placement = kv_placement(plan)
    assert placement is not None
    cells = bytes(unpack_parts(objects[plan["tail"][0]], "tail")[0])
    pieces = [(objects[name], name, int(name.rsplit("-", 1)[-1], 16)) for name, _ in plan["chunks"]]
    pieces.append((cells, "tail", zlib.crc32(cells)))
    step = window or len(pieces)
    windows = [range(a, min(a + step, len(pieces))) for a in range(0, len(pieces), step)]
    random.Random(order).shuffle(windows)
    out = PlacedFile(path, placement)
    try:
        if not order % 3:
            out.prepare()  # (or not: the copies fault the pages in)
        if order % 2:
            out.write_rest(plan, objects)  # the part after the KV cache first (a restore writes both at once)
        for w in windows:
            out.place_window(w.start, pieces[w.start : w.stop], verify)
        if not order % 2:
            out.write_rest(plan, objects)
        return placement.size, out.checksum(plan, verify)
    finally:
        out.close()


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "mamba2"] + ["llama-fa"])
@pytest.mark.parametrize("which", ["g1", "g2", "moved", "fork", "branch"])
def test_pieces_placed_in_any_order_make_the_original_file(
    files: dict[str, Files], arch: str, which: str, tmp_path: Path
) -> None:
    data, _, s = load(getattr(files[arch], which))
    plan, objects = through_json(describe(s)), objects_of(s)
    placement = kv_placement(plan)
    assert placement is not None and len(placement.ranges) == len(s.chunks) + 1
    assert placement.size == len(data) and placement.end < len(data)
    for window, order in ((0, 0), (1, 1), (1, 2), (2, 3), (3, 4)):
        path = tmp_path / f"{window}-{order}.slot"
        assert placed(plan, objects, path, window=window, order=order) == (len(data), 0)  # unverified: no CRC
        assert path.read_bytes() == data
    assert placed(plan, objects, tmp_path / "verified.slot", verify=True) == (len(data), zlib.crc32(data))
    assert (tmp_path / "verified.slot").read_bytes() == data


def test_transposed_v_rows_take_every_piece(files: dict[str, Files]) -> None:
    """Without flash attention V is transposed: each V layer's rows interleave every range (places
    of many rows), with it every range's V is one run."""
    for arch, strided in (("llama", True), ("llama-fa", False)):
        _, _, s = load(files[arch].g1)
        placement = kv_placement(through_json(describe(s)))
        assert placement is not None
        assert any(p.rows > 1 for r in placement.ranges for p in r) is strided


def test_a_recurrent_model_has_nothing_to_place(files: dict[str, Files]) -> None:
    _, _, s = load(files["mamba2"].g1)
    assert kv_placement(through_json(describe(s))) is None


def test_a_manifest_without_body_crc_gets_its_trailer_written_last(
    files: dict[str, Files], tmp_path: Path
) -> None:
    data, _, s = load(files["qwen35"].g1)
    plan = {k: v for k, v in through_json(describe(s)).items() if k not in ("body_crc32", "bounds")}
    assert placed(plan, objects_of(s), tmp_path / "old.slot") == (len(data), zlib.crc32(data))
    assert (tmp_path / "old.slot").read_bytes() == data and read_slot_file(tmp_path / "old.slot").checksum_ok


def test_a_wrong_body_crc_is_caught_when_verifying(files: dict[str, Files], tmp_path: Path) -> None:
    data, _, s = load(files["qwen35"].g1)
    plan = through_json(describe(s))
    plan["body_crc32"] ^= 1
    with pytest.raises(ChecksumError):
        placed(plan, objects_of(s), tmp_path / "checked.slot", verify=True)
    placed(plan, objects_of(s), tmp_path / "unchecked.slot")  # written: the reader refuses its trailer
    assert read_slot_file(tmp_path / "unchecked.slot").checksum_ok is False


# --------------------------------------------------------------------------------- what does not fit
_BAD_VALUES: list[Any] = [None, -1, 0, 2**70, "x", [], {}, 1.5, float("nan"), [[]], ["x", 1], True]


@pytest.mark.parametrize("arch", ["qwen35", "llama-fa"])
@pytest.mark.parametrize("field", ["n_tokens", "state_version", "layout", "chunks", "size", "seq_id"])
def test_malformed_plans_raise_only_slot_file_error(
    files: dict[str, Files], arch: str, field: str, tmp_path: Path
) -> None:
    data, _, s = load(files[arch].g1)
    plan, objects = through_json(describe(s)), objects_of(s)
    for i, bad in enumerate([*_BAD_VALUES, json.loads("Infinity")]):
        broken = copy.deepcopy(plan)
        broken[field] = bad
        _fits_or_slot_file_error(broken, objects, data, tmp_path / f"{i}.slot")
    broken = copy.deepcopy(plan)
    del broken[field]
    _fits_or_slot_file_error(broken, objects, data, tmp_path / "missing.slot")


@pytest.mark.parametrize("arch", ["qwen35", "llama-fa"])
def test_malformed_layouts_raise_only_slot_file_error(
    files: dict[str, Files], arch: str, tmp_path: Path
) -> None:
    data, _, s = load(files[arch].g1)
    plan, objects = through_json(describe(s)), objects_of(s)
    layouts = [
        {**plan["layout"], key: bad} for key in ("cell_bytes", "v_trans", "k", "v") for bad in _BAD_VALUES
    ]
    layouts += [
        {**plan["layout"], key: row}
        for key, row in (
            ("cell_bytes", -24),
            ("cell_bytes", s.layout.cell_bytes - s.layout.bytes_per_token()),  # 0 bytes a token
            ("k", [[1, 0]]),
            ("k", [[1, -5]]),
            ("v", [[1, 2, 0]]),
            ("v", [[1, 0, 256]]),
            ("v", [[1, 2, -1]]),
            ("v", [[1, -2, 256]]),
            ("v", [[1, 2, 1 << 40]]),
            ("k", []),
            ("v", []),
        )
    ]
    for i, layout in enumerate(layouts):
        _fits_or_slot_file_error({**plan, "layout": layout}, objects, data, tmp_path / f"{i}.slot")


def test_chunk_sizes_that_are_not_whole_tokens_are_refused(files: dict[str, Files]) -> None:
    _, _, s = load(files["qwen35"].g1)
    plan = through_json(describe(s))
    for change in (1, -1, -(10**9)):
        broken = copy.deepcopy(plan)
        broken["chunks"][0][1] += change
        with pytest.raises(SlotFileError, match="whole tokens") as info:
            kv_placement(broken)
        assert info.value.kind == "bad_layout"
    more = copy.deepcopy(plan)
    more["chunks"] = more["chunks"] * 3  # more tokens than the plan's
    with pytest.raises(SlotFileError, match="tokens"):
        kv_placement(more)


def test_a_plan_whose_file_is_smaller_than_its_kv_is_refused(files: dict[str, Files], tmp_path: Path) -> None:
    """Nothing is written past the file's end."""
    _, _, s = load(files["llama"].g1)
    plan = through_json(describe(s))
    placement = kv_placement(plan)
    assert placement is not None
    with pytest.raises(SlotFileError):
        kv_placement({**plan, "size": placement.end})


@pytest.mark.parametrize("arch", ["qwen35", "llama-fa"])
def test_damaged_pieces_are_named_or_refused(files: dict[str, Files], arch: str, tmp_path: Path) -> None:
    """A piece that does not fit its places is checked against the CRC in its name: damage is a
    ChecksumError naming it, a piece that is what its name says but does not fit (another file's)
    a SlotFileError; damage that fits is written, and the file's CRC shows it."""
    data, _, s = load(files[arch].g1)
    plan, objects = through_json(describe(s)), objects_of(s)
    name = plan["chunks"][1][0]
    piece = objects[name]
    rng = random.Random(arch)
    for i, bad in enumerate(
        [
            piece[:-1],
            piece + b"\0",
            piece[:7],
            b"",
            bytes(8) + piece[8:],
            _flip(piece, rng.randrange(len(piece))),
        ]
    ):
        path = tmp_path / f"{i}.slot"
        try:
            size, crc = placed(plan, {**objects, name: bad}, path, verify=True)
        except ChecksumError as exc:
            assert name in str(exc)
            continue
        raise AssertionError(f"damage {i} restored as {size} bytes crc {crc:08x}")
    # unverified, a damage inside the data fits its places: written, and the trailer's CRC fails
    placed(plan, {**objects, name: _flip(piece, len(piece) - 1)}, tmp_path / "fits.slot")
    assert read_slot_file(tmp_path / "fits.slot").checksum_ok is False
    # another file's piece under this name, with this name's CRC: refused as not fitting
    _, _, other = load(files["gemma2" if arch == "qwen35" else "qwen35"].g1)
    foreign = other.chunks[1].data
    renamed = {**objects, f"x-{zlib.crc32(foreign):08x}": foreign}
    plan2 = copy.deepcopy(plan)
    plan2["chunks"][1][0] = f"x-{zlib.crc32(foreign):08x}"
    with pytest.raises(SlotFileError):
        placed(plan2, renamed, tmp_path / "foreign.slot")


def _flip(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0x40
    return bytes(out)


def _fits_or_slot_file_error(
    plan: dict[str, Any], objects: dict[str, bytes], data: bytes, path: Path
) -> None:
    """Either refused with SlotFileError or ChecksumError, or the file written is the one write_v1
    writes from the same plan: placing never disagrees with it, and never raises anything else."""
    try:
        if kv_placement(plan) is None:
            return  # nothing to place: a restore writes such a plan with write_v1
        size, _ = placed(plan, objects, path, verify=True)
    except (SlotFileError, ChecksumError):
        return
    expected = write_v1(None, plan, objects)
    assert (size, zlib.crc32(path.read_bytes())) == expected


def test_a_file_closed_while_its_pieces_are_written_closes_after_them(
    files: dict[str, Files], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore that ends (cancelled) while its threads still write: closing never takes the
    descriptor from under them — it closes when the last write is done — and nothing is
    written after."""
    _, _, s = load(files["qwen35"].g1)
    plan, objects = through_json(describe(s)), objects_of(s)
    placement = kv_placement(plan)
    assert placement is not None
    writing, go = threading.Event(), threading.Event()
    pwrite = assembly._pwrite

    def held_up(fd: int, parts: Any) -> None:
        writing.set()
        assert go.wait(30)
        pwrite(fd, parts)  # raises EBADF if the descriptor was closed under it

    monkeypatch.setattr(assembly, "_pwrite", held_up)
    out = PlacedFile(tmp_path / "f.slot", placement)
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(out.write_rest, plan, objects)
        assert writing.wait(30)
        out.close()
        assert out.fd >= 0  # still open: a write is under way
        with pytest.raises(SlotFileError):
            out.place_window(0, [(objects[plan["chunks"][0][0]], "kv", 0)], False)
        go.set()
        done.result(timeout=30)
    assert out.fd == -1

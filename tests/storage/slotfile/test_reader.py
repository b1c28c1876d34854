"""storage.slotfile.reader against v1 files written by the pure-Python writer in conftest.py."""

from __future__ import annotations

import random
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from storage.errors import SlotFileError
from storage.slotfile.reader import read_slot_file, read_tokens, verify_slot_file

U64_MAX = 2**64 - 1
U32_MAX = 2**32 - 1


def put(tmp_path: Path, data: bytes, name: str = "f.slot") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def kind_of(path: Path, **kwargs: Any) -> str:
    with pytest.raises(SlotFileError) as info:
        verify_slot_file(path, **kwargs)
    return info.value.kind


def test_valid_file_parses(tmp_path: Path, slot_writer: Any) -> None:
    spec = slot_writer.Spec(checkpoints=[(2, 0, 1, b"T" * 24), (5, 0, 4, b"")], ckpt_logits=[0, 1])
    path = put(tmp_path, slot_writer.build(spec))
    sf = verify_slot_file(path, fingerprint=spec.fingerprint, n_ctx_slot=128, kv_types=("f16", "f16"))
    assert (sf.format_major, sf.format_minor, sf.state_version, sf.n_tokens) == (1, 0, 3, 6)
    assert sf.checksum_ok is True and sf.computed_crc32 == sf.body_crc32
    assert sf.fingerprint == "ab" * 32 and sf.arch == "qwen35"
    assert [(c.n_tokens, c.pos_min, c.pos_max, c.target_bytes_len) for c in sf.checkpoints] == [
        (2, 0, 1, 24),
        (5, 0, 4, 0),
    ]
    assert (
        path.read_bytes()[sf.checkpoints[0].target_offset : sf.checkpoints[0].target_offset + 24] == b"T" * 24
    )
    assert sf.state_len == 40 and sf.base_len == 12 + 4 * 6 + 40
    assert sum(sf.sizes.values()) == sf.size == path.stat().st_size
    assert sf.sizes["logits"] == 3 * 4 * 8 + 2 * 4
    assert [r.tag for r in sf.records] == [1, 2, 3, 3, 99]
    assert sf.meta["context"]["n_ctx_slot"] == 128
    assert read_tokens(sf) == list(range(100, 106))


def test_without_checkpoints_or_logits(tmp_path: Path, slot_writer: Any) -> None:
    spec = slot_writer.Spec(checkpoints=[], ckpt_logits=[], last_logits=False, extra_records=[], minor=9)
    sf = verify_slot_file(put(tmp_path, slot_writer.build(spec)))
    assert sf.checkpoints == () and sf.ckpt_offset == 0 and sf.ckpt_len == 0
    assert sf.format_minor == 9 and sf.sizes["logits"] == 0 and sf.sizes["checkpoints"] == 0


def test_truncation_at_every_offset(tmp_path: Path, slot_writer: Any) -> None:
    data = slot_writer.build(slot_writer.Spec())
    path = tmp_path / "cut.slot"
    for cut in range(len(data)):
        path.write_bytes(data[:cut])
        assert kind_of(path) == "truncated", cut


def test_flipped_byte_in_every_section(tmp_path: Path, slot_writer: Any) -> None:
    data = slot_writer.build(slot_writer.Spec())
    path = tmp_path / "flip.slot"
    size = len(data)
    for offset in range(size):
        path.write_bytes(data[:offset] + bytes([data[offset] ^ 0xFF]) + data[offset + 1 :])
        expected = "bad_magic" if size - 64 <= offset < size - 56 else "checksum_mismatch"
        assert kind_of(path) == expected, offset
        if offset < size - 64:  # body damage: read_slot_file reports it without crashing
            try:
                assert read_slot_file(path).checksum_ok is False
            except SlotFileError as exc:
                assert exc.kind == "checksum_mismatch" and isinstance(exc.__cause__, SlotFileError)


def _offsets(path: Path) -> dict[str, int]:
    sf = read_slot_file(path)
    return {"ckpt": sf.ckpt_offset, "meta": sf.meta_offset, "size": sf.size}


@pytest.mark.parametrize(
    ("where", "fmt", "value", "kind"),
    [
        ("n_tokens", "<I", U32_MAX, "truncated"),
        ("ckpt_count", "<I", U32_MAX, "truncated"),
        ("ckpt_target_len", "<Q", U64_MAX, "truncated"),
        ("ckpt_target_len", "<Q", 2**40, "truncated"),
        ("n_records", "<I", U32_MAX, "truncated"),
        ("record_len", "<Q", U64_MAX, "truncated"),
        ("t_base_len", "<Q", U64_MAX, "truncated"),
        ("t_ckpt_len", "<Q", 2**63, "truncated"),
        ("t_meta_offset", "<Q", U64_MAX, "truncated"),
        ("t_meta_len", "<Q", 2**62, "truncated"),
    ],
)
def test_huge_counts_and_lengths(
    tmp_path: Path, slot_writer: Any, where: str, fmt: str, value: int, kind: str
) -> None:
    data = slot_writer.build(slot_writer.Spec())
    o = _offsets(put(tmp_path, data))
    t = o["size"] - 64
    at = {
        "n_tokens": 8,
        "ckpt_count": o["ckpt"] + 8,
        "ckpt_target_len": o["ckpt"] + 12 + 16,
        "n_records": o["meta"] + 8,
        "record_len": o["meta"] + 12 + 8,
        "t_base_len": t + 16,
        "t_ckpt_len": t + 32,
        "t_meta_offset": t + 40,
        "t_meta_len": t + 48,
    }[where]
    path = put(tmp_path, slot_writer.patch(data, at, fmt, value), "huge.slot")
    tracemalloc.start()
    try:
        assert kind_of(path) == kind
        assert tracemalloc.get_traced_memory()[1] < 4 << 20  # nothing sized by the bogus value
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    ("change", "kind"),
    [
        ({"major": 2}, "unsupported_version"),
        ({"major": 0}, "unsupported_version"),
        ({"state_version": 2}, "unsupported_version"),
        ({"ckpt_version": 2}, "unsupported_version"),
        ({"meta_version": 0}, "unsupported_version"),
        ({"meta_raw": b'{"format": 2}'}, "unsupported_version"),
        ({"base_magic": 0x12345678}, "bad_magic"),
        ({"ckpt_magic": 0x504B4354}, "bad_magic"),
        ({"meta_magic": 0}, "bad_magic"),
        ({"trailer": {"ckpt_offset": 1}}, "bad_layout"),
        ({"trailer": {"meta_offset": 8}}, "bad_layout"),
        ({"trailer": {"ckpt_len": 0}}, "bad_layout"),
        ({"meta_raw": b"[1, 2]"}, "bad_layout"),
        ({"meta_raw": b"\xff{"}, "bad_layout"),
        ({"meta_raw": b'{"n_tokens": 7}'}, "bad_layout"),
        ({"checkpoints": [(4, 0, 3, b""), (2, 0, 1, b"")], "ckpt_logits": []}, "bad_layout"),
        ({"checkpoints": [(9, 0, 8, b"")]}, "bad_layout"),
        ({"ckpt_count": 0, "ckpt_logits": []}, "bad_layout"),
        ({"ckpt_logits": [3]}, "bad_layout"),
        ({"n_vocab": 8, "extra_records": [(2, 0, b"\0" * 12)]}, "bad_layout"),
        ({"extra_records": [(3, 0, b"\0\0")]}, "bad_layout"),
        ({"extra_records": [(1, 0, b"{}")]}, "bad_layout"),
        ({"n_records": 3}, "bad_layout"),
        ({"n_records": 9}, "truncated"),
        ({"body_crc": 1}, "checksum_mismatch"),
    ],
)
def test_precise_errors(tmp_path: Path, slot_writer: Any, change: dict[str, Any], kind: str) -> None:
    assert kind_of(put(tmp_path, slot_writer.build(slot_writer.Spec(**change)))) == kind


def test_not_a_slot_file(tmp_path: Path) -> None:
    assert kind_of(put(tmp_path, b"")) == "truncated"
    assert kind_of(put(tmp_path, b"x" * 200)) == "bad_magic"


def test_unknown_records_and_flags_are_skipped(tmp_path: Path, slot_writer: Any) -> None:
    spec = slot_writer.Spec(extra_records=[(77, 5, b""), (0xFFFFFFFF, 1, b"z" * 33)], trailer={"flags": 4})
    sf = verify_slot_file(put(tmp_path, slot_writer.build(spec)))
    assert [r.tag for r in sf.records][-2:] == [77, 0xFFFFFFFF] and sf.flags == 4 and sf.notes


def test_meta_size_cap(tmp_path: Path, slot_writer: Any) -> None:
    path = put(tmp_path, slot_writer.build(slot_writer.Spec()))
    with pytest.raises(SlotFileError) as info:
        read_slot_file(path, max_meta_bytes=16)
    assert info.value.kind == "too_large"


def test_expectations(tmp_path: Path, slot_writer: Any) -> None:
    path = put(tmp_path, slot_writer.build(slot_writer.Spec()))
    assert kind_of(path, fingerprint="cd" * 32) == "model_mismatch"
    assert kind_of(path, n_ctx_slot=4) == "shape_mismatch"
    assert kind_of(path, kv_types=("q8_0", "q8_0")) == "shape_mismatch"
    assert kind_of(path, max_bytes=100) == "too_large"
    assert kind_of(path, state_versions={2}) == "unsupported_version"


def test_checksum_can_be_skipped(tmp_path: Path, slot_writer: Any) -> None:
    sf = read_slot_file(put(tmp_path, slot_writer.build(slot_writer.Spec(body_crc=7))), checksum=False)
    assert sf.checksum_ok is None and sf.computed_crc32 is None


def test_fuzzed_files_only_raise_slot_file_errors(tmp_path: Path, slot_writer: Any) -> None:
    """Random patches with CRCs fixed up, so the section parsers (not the CRC) meet the damage."""
    data = slot_writer.build(slot_writer.Spec(checkpoints=[(2, 0, 1, b"T" * 24), (5, 0, 4, b"U")]))
    rng = random.Random(4)
    path = tmp_path / "fuzz.slot"
    outcomes: set[str] = set()
    for _ in range(400):
        image = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(image) - 64)
            image[at : at + 8] = rng.randbytes(8)[: len(image) - 64 - at]
        path.write_bytes(slot_writer.refix(image))
        try:
            verify_slot_file(path)
            outcomes.add("ok")
        except SlotFileError as exc:
            outcomes.add(exc.kind)
    assert {"truncated", "bad_layout"} <= outcomes


@pytest.mark.slow
def test_large_file_streams(tmp_path: Path, slot_writer: Any) -> None:
    path = slot_writer.write(tmp_path / "big.slot", slot_writer.Spec(state_size=48 << 20))
    tracemalloc.start()
    try:
        sf = verify_slot_file(path)
        assert tracemalloc.get_traced_memory()[1] < 4 << 20
    finally:
        tracemalloc.stop()
    assert sf.state_len == 48 << 20 and sum(sf.sizes.values()) == path.stat().st_size

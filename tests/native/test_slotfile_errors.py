"""Damaged, truncated, foreign and oversized slot files: a precise SlotFileError, the slot left
empty, and the engine still answering. Crafted files get valid checksums so that the bounds checks
behind the checksum are exercised too."""

from __future__ import annotations

import ctypes
import struct
import zlib
from pathlib import Path

import pytest

import native

TRAILER = 64


def _layout(data: bytes) -> dict[str, int]:
    t = data[-TRAILER:]
    base_len, ckpt_off, ckpt_len, meta_off, meta_len = struct.unpack_from("<5Q", t, 16)
    return {
        "base_len": base_len,
        "ckpt_off": ckpt_off,
        "ckpt_len": ckpt_len,
        "meta_off": meta_off,
        "meta_len": meta_len,
    }


def _reseal(body: bytes, trailer: bytearray) -> bytes:
    """Recompute both CRCs so only the structural checks can catch what was changed."""
    struct.pack_into("<I", trailer, 56, zlib.crc32(body))
    struct.pack_into("<I", trailer, 60, zlib.crc32(bytes(trailer[:60])))
    return body + bytes(trailer)


def _patch(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    body = bytearray(data[:-TRAILER])
    struct.pack_into(fmt, body, offset, value)
    return _reseal(bytes(body), bytearray(data[-TRAILER:]))


def _patch_trailer(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    trailer = bytearray(data[-TRAILER:])
    struct.pack_into(fmt, trailer, offset, value)
    return _reseal(data[:-TRAILER], trailer)


@pytest.fixture
def saved(make_engine, greedy, tmp_path: Path):
    """A qwen35 engine whose slot 0 was saved with checkpoints; returns (engine, file bytes, prompt)."""
    eng = make_engine("qwen35", n_slots=2)
    prompt = eng.tokenize("The quick brown fox jumps over the lazy dog. " * 30)
    eng.generate(0, greedy(prompt, 6, checkpoint_hints=[40, 120]))
    path = tmp_path / "good.slot"
    info = eng.save_slot(0, str(path))
    assert info.n_checkpoints >= 3
    return eng, path.read_bytes(), prompt


def _expect(eng, greedy, prompt, tmp_path: Path, data: bytes, kinds: set[str]) -> native.SlotFileError:
    bad = tmp_path / "bad.slot"
    bad.write_bytes(data)
    eng.generate(1, greedy(prompt[:50], 2))  # the slot holds a session before the failed restore
    with pytest.raises(native.SlotFileError) as err:
        eng.restore_slot(1, str(bad))
    assert err.value.kind in kinds, f"{err.value.kind}: {err.value}"
    assert eng.slot_tokens(1) == [], "a failed restore must leave the slot empty"
    again = eng.generate(1, greedy(prompt[:50], 2))  # and the engine keeps serving
    assert again.timings.prompt_n == 50
    return err.value


def test_good_file_roundtrips_and_base_payload_is_llama_cpp_format(saved, tmp_path: Path):
    eng, data, prompt = saved
    lay = _layout(data)
    assert lay["ckpt_off"] == lay["base_len"] and lay["meta_off"] == lay["ckpt_off"] + lay["ckpt_len"]
    magic, version, n_tokens = struct.unpack_from("<3I", data, 0)
    assert magic == 0x67677371 and version == native.STATE_SEQ_VERSION and n_tokens == len(prompt) + 5
    assert zlib.crc32(data[:-TRAILER]) == struct.unpack_from("<I", data, len(data) - 8)[0]

    # llama.cpp's own loader reads the base payload and stops exactly where our sections begin.
    import llama_cpp as lc

    path = tmp_path / "good.slot"
    mparams = lc.llama_model_default_params()
    model = lc.llama_model_load_from_file(eng.model.path.encode(), mparams)
    cparams = lc.llama_context_default_params()
    cparams.n_ctx, cparams.n_seq_max, cparams.kv_unified = 1024, 1, True
    cparams.flash_attn_type = 0  # the engine runs without flash attention: V is stored transposed
    ctx = lc.llama_init_from_model(model, cparams)
    try:
        toks = (lc.llama_token * 2048)()
        n_out = ctypes.c_size_t(0)
        off = lc.llama_state_seq_load_file(ctx, str(path).encode(), 0, toks, 2048, ctypes.byref(n_out))
        assert off == lay["base_len"]
        assert list(toks[: n_out.value]) == eng.slot_tokens(0)
    finally:
        lc.llama_free(ctx)
        lc.llama_model_free(model)


def test_truncated_files(saved, greedy, tmp_path: Path):
    eng, data, prompt = saved
    lay = _layout(data)
    cuts = [
        0,
        1,
        11,
        12,
        63,
        64,
        100,
        lay["base_len"] - 1,
        lay["base_len"],
        lay["ckpt_off"] + 20,
        lay["meta_off"] + 7,
        len(data) - TRAILER,
        len(data) - 1,
    ]
    for cut in cuts:
        _expect(eng, greedy, prompt, tmp_path, data[:cut], {"truncated", "bad_magic"})


def test_flipped_bytes_in_every_section(saved, greedy, tmp_path: Path):
    eng, data, prompt = saved
    lay = _layout(data)
    spots = {
        "base header": 5,
        "tokens": 20,
        "state": lay["base_len"] - 10,
        "checkpoint": lay["ckpt_off"] + lay["ckpt_len"] // 2,
        "records": lay["meta_off"] + 30,
        "trailer fields": len(data) - 40,
        "trailer magic": len(data) - TRAILER + 2,
        "body crc": len(data) - 6,
    }
    for where, off in spots.items():
        flipped = bytearray(data)
        flipped[off] ^= 0x5A
        err = _expect(eng, greedy, prompt, tmp_path, bytes(flipped), {"checksum_mismatch", "bad_magic"})
        assert "checksum" in str(err) or "magic" in str(err), where


def test_huge_counts_and_lengths_with_valid_checksums(saved, greedy, tmp_path: Path):
    eng, data, prompt = saved
    lay = _layout(data)
    c, m = lay["ckpt_off"], lay["meta_off"]
    cases = [
        (_patch(data, 8, "<I", 0xFFFFFFFF), {"too_large", "truncated"}),  # n_tokens
        (_patch(data, c + 8, "<I", 0x7FFFFFFF), {"truncated"}),  # checkpoint count
        (_patch(data, c + 12 + 16, "<Q", 1 << 62), {"truncated"}),  # first state blob length
        (_patch(data, m + 8, "<I", 0xFFFFFFFF), {"truncated"}),  # record count
        (_patch(data, m + 12 + 8, "<Q", 1 << 60), {"truncated"}),  # first record length
        (_patch(data, c + 12, "<q", 1 << 40), {"bad_layout"}),  # checkpoint past the tokens
        (_patch_trailer(data, 16, "<Q", 1 << 50), {"bad_layout"}),  # base_len
        (_patch_trailer(data, 40, "<Q", 3), {"bad_layout"}),  # meta offset
    ]
    for bad, kinds in cases:
        _expect(eng, greedy, prompt, tmp_path, bad, kinds)


def test_versions(saved, greedy, tmp_path: Path):
    eng, data, prompt = saved
    lay = _layout(data)
    err = _expect(eng, greedy, prompt, tmp_path, _patch(data, 4, "<I", 99), {"unsupported_version"})
    assert "version 99" in str(err)
    _expect(eng, greedy, prompt, tmp_path, _patch_trailer(data, 8, "<H", 2), {"unsupported_version"})
    _expect(
        eng, greedy, prompt, tmp_path, _patch(data, lay["ckpt_off"] + 4, "<I", 2), {"unsupported_version"}
    )
    _expect(
        eng, greedy, prompt, tmp_path, _patch(data, lay["meta_off"] + 4, "<I", 7), {"unsupported_version"}
    )


def test_foreign_model_and_limits(saved, make_engine, greedy, tmp_path: Path):
    eng, data, prompt = saved
    # Same architecture and shapes, other weights: only the fingerprint tells them apart.
    other = make_engine("qwen35", n_slots=2, seed=1)
    assert other.model.fingerprint != eng.model.fingerprint
    err = _expect(other, greedy, prompt, tmp_path, data, {"model_mismatch"})
    assert "another model" in str(err)
    llama = make_engine("llama", n_slots=2)
    _expect(llama, greedy, llama.tokenize("x " * 40), tmp_path, data, {"model_mismatch"})
    # A limit on file size, and a slot too small for the saved tokens.
    capped = make_engine("qwen35", n_slots=2, max_slot_file_bytes=len(data) - 1)
    _expect(capped, greedy, prompt, tmp_path, data, {"too_large"})
    small = make_engine("qwen35", n_slots=2, n_ctx=2 * 128)
    _expect(small, greedy, prompt[:60], tmp_path, data, {"too_large"})


def test_checkpoint_logits_with_wrong_vocab_size(saved, greedy, tmp_path: Path):
    eng, data, prompt = saved
    lay = _layout(data)
    # The first record is META; the second is the last logits (tag 2): shrink its length by 4.
    m = lay["meta_off"] + 12
    meta_len = struct.unpack_from("<Q", data, m + 8)[0]
    second = m + 16 + meta_len
    assert struct.unpack_from("<I", data, second)[0] == 2
    _expect(
        eng,
        greedy,
        prompt,
        tmp_path,
        _patch(data, second + 8, "<Q", 4 * eng.model.n_vocab - 4),
        {"model_mismatch", "truncated"},
    )


def test_missing_file_and_directory(saved, tmp_path: Path):
    eng, _, _ = saved
    with pytest.raises(native.SlotFileError) as err:
        eng.restore_slot(0, str(tmp_path / "nope.slot"))
    assert err.value.kind == "io"
    with pytest.raises(native.SlotFileError) as err:
        eng.restore_slot(0, str(tmp_path))
    assert err.value.kind == "io"

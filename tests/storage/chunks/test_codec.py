"""storage.chunks.codec: how a state piece is stored (compressed byte planes or as it is), and that what
comes back is exactly what went in — or a ChecksumError, never a crash or other bytes unnoticed."""

from __future__ import annotations

import random
import struct
import zlib

import numpy as np
import pytest
import zstandard

from storage.chunks.codec import MAGIC, decode, encode
from storage.errors import ChecksumError


def _state(n: int = 200_000, seed: int = 0) -> bytes:
    """Like a recurrent state: the piece magic, then f32 values of one scale."""
    return b"SKPT" + (np.random.default_rng(seed).standard_normal(n).astype(np.float32) * 0.2).tobytes()


def test_a_state_is_stored_smaller_and_read_back_exactly() -> None:
    raw = _state()
    stored = encode(raw)
    assert stored[:4] == MAGIC and len(stored) < 0.9 * len(raw)
    assert decode(stored, len(raw), "k") == raw


@pytest.mark.parametrize("size", [0, 1, 7, 4096 + 3])
def test_sizes_not_a_multiple_of_four_and_tiny_pieces(size: int) -> None:
    raw = (b"SKPT" + bytes(range(256)) * 20)[:size]
    assert decode(encode(raw), len(raw), "k") == raw


def test_what_does_not_shrink_is_stored_as_it_is() -> None:
    raw = b"SKPT" + random.Random(1).randbytes(100_000)
    assert encode(raw) == raw
    assert decode(raw, len(raw), "k") == raw


def test_a_piece_is_never_stored_larger_than_it_is() -> None:
    """Small pieces whose exponent plane shrinks a little: the header would cost more than the
    plane saves, so they are stored as they are."""
    rng = np.random.default_rng(3)
    for n in range(20, 400, 7):
        grid = rng.integers(0, 256, (n, 4), dtype=np.uint8)
        grid[:, 3] = rng.integers(0, 16, n)
        raw = grid.tobytes()
        stored = encode(raw)
        assert stored is raw or len(stored) < len(raw), n
        assert decode(stored, len(raw), "k") == raw


def test_pieces_stored_before_the_codec_read_as_they_are() -> None:
    raw = _state(1000)
    assert decode(raw, len(raw), "k") is raw


def test_a_size_other_than_the_manifests_is_refused_before_decoding() -> None:
    raw = _state(10_000)
    with pytest.raises(ChecksumError, match="manifest says"):
        decode(encode(raw), len(raw) + 4, "ck-key")
    with pytest.raises(ChecksumError, match="ck-key"):
        decode(MAGIC + b"\x01" + (1 << 40).to_bytes(8, "little") + b"x" * 64, 1 << 40, "ck-key")


def test_damage_is_refused_or_changes_the_bytes_the_crc_then_catches() -> None:
    """Flipped bits, cut ends and garbage headers: never a crash; a decode that succeeds gives
    bytes of the right size, whose CRC (the one in the piece's name) tells them apart."""
    raw = _state(50_000)
    crc, stored = zlib.crc32(raw), encode(raw)
    rng = random.Random(7)
    refused = 0
    for i in range(600):
        b = bytearray(stored)
        if i % 3 == 0:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif i % 3 == 1:
            b = b[: rng.randrange(len(b))]
        else:
            b[rng.randrange(4, 64)] = rng.randrange(256)
        try:
            out = decode(bytes(b), len(raw), "k")
        except ChecksumError:
            refused += 1
            continue
        assert len(out) == len(raw)
        assert out == raw or zlib.crc32(out) != crc
    assert refused >= 200  # every cut end at least


def test_a_plane_that_says_it_is_larger_is_refused_before_it_is_decoded() -> None:
    """A frame sizes its own output: one that claims more than its plane's share of the piece's
    size (a forged or damaged header) is refused before anything is allocated for it."""
    raw = _state(10_000)
    stored = bytearray(encode(raw))
    head = struct.Struct("<4sBQB4Q")
    _, codec, size, mask, *lengths = head.unpack_from(stored)
    huge = zstandard.ZstdCompressor().compress(bytes(1 << 24))
    frames_at = head.size + sum(lengths[:3])
    forged = bytes(stored[:frames_at]) + huge + bytes(stored[frames_at + lengths[3] :])
    forged = head.pack(MAGIC, codec, size, mask, *lengths[:3], len(huge)) + forged[head.size :]
    with pytest.raises(ChecksumError, match="says it holds"):
        decode(forged, len(raw), "k")

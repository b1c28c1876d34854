"""storage.chunks._planes: a state's bytes split into f32 byte planes and put back, against a plain
Python reading of the same layout, at sizes the 16-byte loops do not divide; and buffers it cannot
use are refused with a ValueError, never read or written out of bounds."""

from __future__ import annotations

import random

import pytest

from storage.chunks import _planes


def _planes_of(raw: bytes, n: int) -> list[bytes]:
    return [raw[k : 4 * n : 4] for k in range(4)]


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 63, 64, 1000, 4099])
def test_split_puts_byte_k_of_every_float_together(n: int) -> None:
    raw = random.Random(n).randbytes(4 * n + 3)  # (3 bytes past the floats: not read)
    assert _planes.split(raw, n) == b"".join(_planes_of(raw, n))


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 63, 64, 1000, 4099])
def test_interleave_puts_back_what_split_took_apart(n: int) -> None:
    raw = random.Random(n).randbytes(4 * n)
    split = memoryview(_planes.split(raw, n))
    out = bytearray(4 * n + 2)  # (the 2 bytes past the floats are left alone)
    out[-2:] = b"xy"
    _planes.interleave(memoryview(out), *(split[k * n : (k + 1) * n] for k in range(4)))
    assert bytes(out) == raw + b"xy"


def test_split_refuses_more_floats_than_the_buffer_holds() -> None:
    with pytest.raises(ValueError, match="fewer than 3 floats"):
        _planes.split(b"\0" * 11, 3)


def test_interleave_refuses_a_plane_of_another_size() -> None:
    out = bytearray(40)
    with pytest.raises(ValueError, match="plane 2 is 9 bytes, not 10"):
        _planes.interleave(out, b"a" * 10, b"b" * 10, b"c" * 9, b"d" * 10)
    assert out == bytearray(40)


def test_interleave_refuses_a_read_only_or_strided_buffer() -> None:
    plane = b"p" * 4
    with pytest.raises((ValueError, BufferError)):
        _planes.interleave(bytes(16), plane, plane, plane, plane)
    with pytest.raises(ValueError, match="contiguous"):
        _planes.interleave(bytearray(16), memoryview(b"p" * 8)[::2], plane, plane, plane)

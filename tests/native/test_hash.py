"""The core's CRC-32 (zlib's where it is linked, the portable slicing-by-8 one otherwise) is
zlib.crc32's, for any length and when chained — slot files written by one reader verify in the other."""

from __future__ import annotations

import random
import zlib

import pytest

from native import _native


@pytest.mark.parametrize("crc", [_native.crc32, _native.crc32_portable], ids=["crc32", "portable"])
def test_crc32_is_zlibs(crc) -> None:
    rng = random.Random(5)
    # Around the 64-byte blocks and 16-byte folds of the carry-less-multiply path.
    for n in (0, 1, 7, 8, 9, 15, 16, 63, 64, 65, 79, 80, 127, 128, 129, 1000, 4096, 65_537, 1 << 20):
        data = rng.randbytes(n)
        assert crc(data) == zlib.crc32(data)
        head, tail = data[: n // 3], data[n // 3 :]
        assert crc(tail, crc(head)) == zlib.crc32(data)


def test_crc32_of_unaligned_slices_and_running_values() -> None:
    rng = random.Random(11)
    data = rng.randbytes(10_000)
    for _ in range(300):
        start = rng.randrange(0, 200)
        end = rng.randrange(start, len(data) + 1)
        value = rng.getrandbits(32)
        piece = data[start:end]
        assert _native.crc32(piece, value) == zlib.crc32(piece, value) == _native.crc32_portable(piece, value)

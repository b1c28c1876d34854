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
    for n in (0, 1, 7, 8, 9, 63, 64, 1000, 65_537):
        data = rng.randbytes(n)
        assert crc(data) == zlib.crc32(data)
        head, tail = data[: n // 3], data[n // 3 :]
        assert crc(tail, crc(head)) == zlib.crc32(data)

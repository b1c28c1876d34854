"""storage.checksum: CRC combination and the checksum encodings used with S3."""

from __future__ import annotations

import base64
import random
import zlib
from pathlib import Path

import pytest

from storage.checksum import (
    composite_crc32_b64,
    crc32_b64,
    crc32_combine,
    crc32_of_parts,
    file_crc32,
    format_checksum,
    parse_checksum,
)
from storage.errors import ChecksumError


def test_combine_matches_zlib() -> None:
    rng = random.Random(1)
    for _ in range(50):
        a, b = rng.randbytes(rng.randrange(0, 3000)), rng.randbytes(rng.randrange(0, 3000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    parts = [rng.randbytes(n) for n in (5, 0, 1 << 16, 77)]
    assert crc32_of_parts([(zlib.crc32(p), len(p)) for p in parts]) == zlib.crc32(b"".join(parts))


def test_file_crc_streams_ranges(tmp_path: Path) -> None:
    data = random.Random(2).randbytes(3 << 20)
    (tmp_path / "f").write_bytes(data)
    assert file_crc32(tmp_path / "f") == zlib.crc32(data)
    assert file_crc32(tmp_path / "f", 10, len(data) - 64) == zlib.crc32(data[10:-64])


def test_encodings() -> None:
    assert format_checksum(0xAB) == "crc32:000000ab" and parse_checksum("crc32:000000ab") == 0xAB
    for bad in ("crc32:ab", "md5:000000ab", "", "crc32:0000000G"):
        with pytest.raises(ChecksumError):
            parse_checksum(bad)
    assert base64.b64decode(crc32_b64(0x01020304)) == b"\x01\x02\x03\x04"
    assert composite_crc32_b64([1, 2]).endswith("-2")

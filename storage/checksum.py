"""CRC-32 (zlib / ISO-HDLC) helpers shared by the slot-file reader and the blob stores.

Transfers split a file into parts that are checksummed in parallel; :func:`crc32_combine` joins
the part CRCs into the whole-file CRC without a second pass over the bytes (zlib's algorithm:
multiply by x^(8·len2) modulo the CRC polynomial).
"""

from __future__ import annotations

import base64
import os
import re
import zlib
from pathlib import Path

from storage.errors import ChecksumError

CHUNK = 1 << 20
_POLY = 0xEDB88320  # reflected ISO-HDLC polynomial
_CHECKSUM_TEXT = re.compile(r"crc32:([0-9a-f]{8})")


def _multmodp(a: int, b: int) -> int:
    """a·b modulo the CRC polynomial, both in zlib's reflected bit order."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> tuple[int, ...]:
    p = 1 << 30  # x^1
    table = [p]
    for _ in range(31):
        p = _multmodp(p, p)
        table.append(p)
    return tuple(table)


_X2N = _x2n_table()


def _x8nmodp(n: int) -> int:
    """x^(8·n) modulo the polynomial."""
    p = 1 << 31  # x^0
    k = 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)``."""
    if len2 < 0:
        raise ValueError("len2 must be >= 0")
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2


def crc32_of_parts(parts: list[tuple[int, int]]) -> int:
    """Whole CRC from ``[(crc, length), ...]`` in file order."""
    crc = 0
    for part_crc, length in parts:
        crc = crc32_combine(crc, part_crc, length)
    return crc


def file_crc32(path: str | Path, start: int = 0, end: int | None = None) -> int:
    """Stream the CRC-32 of ``path[start:end]`` in 1 MiB reads (never the whole file in memory)."""
    crc = 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        left = (os.fstat(f.fileno()).st_size if end is None else end) - start
        while left > 0:
            n = f.readinto(view[: min(CHUNK, left)])
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
            left -= n
    return crc


def format_checksum(crc: int) -> str:
    """The object-metadata form, ``crc32:%08x``."""
    return f"crc32:{crc & 0xFFFFFFFF:08x}"


def parse_checksum(text: str) -> int:
    match = _CHECKSUM_TEXT.fullmatch(text or "")
    if match is None:
        raise ChecksumError(f"unrecognised checksum {text!r} (expected crc32:%08x)")
    return int(match[1], 16)


def crc32_b64(crc: int) -> str:
    """The S3 ``ChecksumCRC32`` form: base64 of the big-endian u32."""
    return base64.b64encode((crc & 0xFFFFFFFF).to_bytes(4, "big")).decode("ascii")


def composite_crc32_b64(part_crcs: list[int]) -> str:
    """S3's COMPOSITE multipart checksum: CRC of the concatenated big-endian part CRCs, ``-N``."""
    joined = b"".join((c & 0xFFFFFFFF).to_bytes(4, "big") for c in part_crcs)
    return f"{crc32_b64(zlib.crc32(joined))}-{len(part_crcs)}"

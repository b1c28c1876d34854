"""How a state piece is stored: its bytes as they are, or compressed in byte planes.

Checkpoints and tails are mostly f32 (recurrent states, logits). Within a float the sign-and-
exponent byte varies little while the mantissa bytes are noise, so the bytes are split into four
planes (every 4th byte together); a plane that zstd (fastest level) shrinks is stored as its frame,
the others as they are: the exponent plane shrinks well, the mantissa planes do not, so a state
shrinks by a modest fraction (figures: docs/benchmarks.md, "Figures formerly in code comments").
Splitting and putting the planes back is C (:mod:`storage.chunks._planes`), a small part of the
time; the rest is zstd. Both release the GIL, so a restore decodes its pieces beside its other reads
and writes. A short turn of a hybrid model writes two or three such states beside its new tokens'
KV, so this is most of what the turn saves. KV chunks are stored as they are.

Lossless: :func:`decode` gives back exactly the bytes whose CRC-32 the piece's name carries (the
restore's checks are on those). A stored piece says how it is stored by its first four bytes:
``SKZ1`` here, the raw piece's own ``SKPT`` otherwise — pieces stored before this codec, by a store
that does not compress (``ChunkedStore(compress=False)``, the node's ``--store-compression``) and
pieces it would not have shrunk read as before.
"""

from __future__ import annotations

import struct

import zstandard

from storage.chunks import _planes
from storage.errors import ChecksumError

MAGIC = b"SKZ1"
_STRIDE = 4  # f32
_HEAD = struct.Struct("<4sBQB4Q")  # magic, codec, raw size, planes compressed (bit k), lengths
_PLANES_ZSTD = 2
_LEVEL = 1  # the exponent plane is easy, the mantissa planes are noise at any level
_WORTH = 0.95  # a plane that zstd shrinks less is stored as it is: read back without a copy


def encode(raw: bytes) -> bytes:
    """The bytes to store for a state piece: its compressed byte planes when smaller, else ``raw``."""
    n = len(raw) // _STRIDE
    planes = memoryview(_planes.split(raw, n))
    cctx = zstandard.ZstdCompressor(level=_LEVEL)
    frames: list[bytes | memoryview] = []
    mask = 0
    for k in range(_STRIDE):
        plane = planes[k * n : (k + 1) * n]
        frame = cctx.compress(plane)
        if len(frame) < _WORTH * n:
            frames.append(frame)
            mask |= 1 << k
        else:
            frames.append(plane)
    rest = raw[n * _STRIDE :]
    if mask == 0 or _HEAD.size + sum(map(len, frames)) + len(rest) >= len(raw):
        return raw  # (a small piece: what a plane saves may not pay for the header)
    return b"".join([_HEAD.pack(MAGIC, _PLANES_ZSTD, len(raw), mask, *map(len, frames)), *frames, rest])


def decode(stored: bytes, size: int, what: str) -> bytes | bytearray:
    """The piece's raw bytes from what the store holds; ``size`` is the raw size its manifest
    names, and no plane decodes to more than its share of it. :class:`ChecksumError` for a frame
    that is not one (the piece is then damaged, like one whose bytes fail the CRC in its name)."""
    if stored[:4] != MAGIC:
        return stored
    view = memoryview(stored)
    n = size // _STRIDE
    try:
        _, codec, raw_size, mask, *lengths = _HEAD.unpack_from(view)
        if codec != _PLANES_ZSTD or raw_size != size:
            raise ValueError(f"codec {codec} of {raw_size} bytes; its manifest says {size}")
        if _HEAD.size + sum(lengths) + size % _STRIDE != len(view):
            raise ValueError(f"frames of {sum(lengths)} bytes in {len(view)}")
        dctx, pos = zstandard.ZstdDecompressor(), _HEAD.size
        planes: list[bytes | memoryview] = []
        for k, length in enumerate(lengths):
            frame = view[pos : pos + length]
            pos += length
            if not mask & (1 << k):
                if length != n:
                    raise ValueError(f"plane {k} is {length} bytes, not {n}")
                planes.append(frame)
                continue
            if zstandard.frame_content_size(frame) != n:  # (it sizes the output: checked first)
                raise ValueError(f"plane {k} says it holds other than {n} bytes")
            plane = dctx.decompress(frame, max_output_size=n)
            if len(plane) != n:
                raise ValueError(f"plane {k} decodes to {len(plane)} bytes, not {n}")
            planes.append(plane)
        out = bytearray(size)
        _planes.interleave(memoryview(out)[: n * _STRIDE], *planes)
        out[n * _STRIDE :] = view[pos:]
    except (ValueError, struct.error, zstandard.ZstdError) as exc:
        raise ChecksumError(f"{what}: its stored bytes do not decode ({exc})") from None
    return out  # (a bytearray: no second copy of the piece)

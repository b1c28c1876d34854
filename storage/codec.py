"""How a state piece is stored: its bytes as they are, or compressed in byte planes.

Checkpoints and tails are mostly f32 (recurrent states, logits). Within a float the sign-and-
exponent byte varies little while the mantissa bytes are noise, so the bytes are shuffled into
planes (Blosc2's SIMD shuffle) and compressed with zstd at its fastest level: about 0.85× on the
bench model's 6.9 MB recurrent state, ~8 ms to write on one thread, ~2 ms to read back. A short
turn of a hybrid model writes two or three such states beside its new tokens' KV, so this is most
of what the turn saves. KV chunks are stored as they are: a restore reads them at memory speed.

Lossless: :func:`decode` gives back exactly the bytes whose CRC-32 the piece's name carries (the
restore's checks are on those). A stored piece says how it is stored by its first four bytes:
``SKZ1`` here, the raw piece's own ``SKPT`` otherwise — pieces stored before this codec, by a store
that does not compress (``ChunkedStore(compress=False)``, the node's ``--store-compression``) and
pieces it would not have shrunk read as before.
"""

from __future__ import annotations

import struct

import blosc2

from storage.errors import ChecksumError

MAGIC = b"SKZ1"
_HEAD = struct.Struct("<4sBQ")  # magic, codec, raw size
_SHUFFLE_ZSTD = 1
_MAX = (1 << 31) - (1 << 20)  # a Blosc2 chunk's limit; larger pieces are stored raw
_CPARAMS = {
    "codec": blosc2.Codec.ZSTD,
    "clevel": 1,  # the exponent plane is easy and the mantissa planes are noise at any level
    "typesize": 4,  # f32
    "filters": [blosc2.Filter.SHUFFLE],
    "nthreads": 1,  # saves run beside the request path: one core
}
# Blosc2 holds the GIL while it decodes: two threads of its own halve the time the restore's
# other piece reads and writes wait for it.
_DECODE_THREADS = 2


def encode(raw: bytes) -> bytes:
    """The bytes to store for a state piece: its compressed byte planes when smaller, else ``raw``."""
    if len(raw) > _MAX:
        return raw
    packed = blosc2.compress2(raw, **_CPARAMS)
    if len(packed) + _HEAD.size >= len(raw):
        return raw
    return _HEAD.pack(MAGIC, _SHUFFLE_ZSTD, len(raw)) + packed


def decode(stored: bytes, size: int, what: str) -> bytes:
    """The piece's raw bytes from what the store holds; ``size`` is the raw size its manifest
    names, and nothing larger is ever allocated. :class:`ChecksumError` for a frame that is not one
    (the piece is then damaged, like one whose bytes fail the CRC in its name)."""
    if stored[:4] != MAGIC:
        return stored
    view = memoryview(stored)
    try:
        _, codec, raw_size = _HEAD.unpack_from(view)
        if codec != _SHUFFLE_ZSTD or raw_size != size:
            raise ValueError(f"codec {codec} of {raw_size} bytes; its manifest says {size}")
        nbytes, cbytes, _ = blosc2.get_cbuffer_sizes(view[_HEAD.size :])
        if nbytes != size or cbytes != len(view) - _HEAD.size:
            raise ValueError(f"a frame of {nbytes} bytes in {cbytes}, {len(view) - _HEAD.size} stored")
        raw = blosc2.decompress2(view[_HEAD.size :], nthreads=_DECODE_THREADS)
    except (ValueError, RuntimeError, struct.error) as exc:
        raise ChecksumError(f"{what}: its stored bytes do not decode ({exc})") from None
    if len(raw) != size:
        raise ChecksumError(f"{what}: decodes to {len(raw)} bytes, its manifest says {size}")
    return bytes(raw)

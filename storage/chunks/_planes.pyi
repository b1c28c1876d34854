"""Typed surface of storage's compiled byte planes (native/src/planes.cpp): f32 byte planes for
:mod:`storage.chunks.codec`, both with the GIL released. No libllama."""

from typing_extensions import Buffer

def split(raw: Buffer, n: int) -> bytes:
    """The first ``4 * n`` bytes of ``raw`` as four planes back to back: byte k of float i at k*n + i."""

def interleave(out: Buffer, p0: Buffer, p1: Buffer, p2: Buffer, p3: Buffer) -> None:
    """Byte k of float i of ``out`` (writable) from plane k, each ``len(out) // 4`` bytes."""

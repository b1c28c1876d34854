"""Where each KV piece's parts go in the v1 file a manifest's plan describes (pure).

A v1 file lays the KV cache out part by part — every range's tokens, then every range's cells,
then each layer's K and V — with the ranges side by side inside each part (inside each row of a
transposed V). One piece's parts therefore land at many places, and those places follow from the
plan alone: a piece's token count from its size (:meth:`KvLayout.bytes_per_token`). So a restore
can write each piece into its places as it arrives and drop it
(:mod:`storage.chunks.assembly`), holding a few pieces instead of the whole state.
:func:`storage.chunks.chunking.write_v1` writes the same bytes from every piece at once.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from storage.chunks.chunking import TYPE_EL, TYPE_ROW, KvLayout
from storage.errors import SlotFileError
from storage.slotfile.format import BASE_MAGIC, TRAILER_SIZE

_U32, _I32 = struct.Struct("<I"), struct.Struct("<i")
_MAX_SIZE = 1 << 40  # a file size no state reaches: a larger one is a damaged plan


@dataclass(frozen=True)
class Place:
    """``rows`` runs of ``width`` bytes, the first at ``offset``, each ``stride`` bytes after the
    one before (one run: ``rows`` is 1)."""

    offset: int
    width: int
    rows: int = 1
    stride: int = 0

    @property
    def nbytes(self) -> int:
        return self.rows * self.width


@dataclass(frozen=True)
class KvPlacement:
    """The KV cache of a plan's file: its own bytes (magic, counts, each layer's head) at their
    offsets, and for each range of tokens — the plan's chunks in order, then the tail's cells —
    the place of each of its parts (tokens, cells, each K layer, each V layer)."""

    fixed: tuple[tuple[int, bytes], ...]
    ranges: tuple[tuple[Place, ...], ...]
    end: int  # where the KV cache ends: the base's tail (then the checkpoints) follows
    size: int  # of the whole file
    cell_bytes: int
    seq: bytes | None  # the sequence id put into every cell; None: the pieces keep theirs


def kv_placement(plan: Mapping[str, Any]) -> KvPlacement | None:
    """The placement of a plan's KV cache; None when the plan has no KV layout (the whole state is
    in the tail). :class:`SlotFileError` (``bad_layout``) when the chunks' sizes do not fit it or
    the KV cache does not fit the plan's file size: every place lies inside the file."""
    try:
        return _placement(plan)
    except (KeyError, IndexError, TypeError, ValueError, OverflowError, struct.error) as exc:
        raise SlotFileError("bad_layout", f"manifest plan does not place its chunks: {exc}") from exc


def _placement(plan: Mapping[str, Any]) -> KvPlacement | None:
    if plan["layout"] is None:
        return None
    layout = KvLayout.from_json(plan["layout"])
    rows = [layout.cell_bytes, *(row for _, row in layout.k), *(size for _, size, _ in layout.v)]
    if (
        layout.v_trans not in (0, 1)
        or min(rows) <= 0
        or any(e <= 0 for _, _, e in layout.v if layout.v_trans)
    ):
        raise ValueError("its KV layout has sizes that are not sizes")
    n = int(plan["n_tokens"])
    n_parts = 2 + len(layout.k) + len(layout.v)
    head, per_token = 8 + 8 * n_parts, layout.bytes_per_token()
    counts = []
    for name, size in plan["chunks"]:
        m, rest = divmod(int(size) - head, per_token)
        if rest or m <= 0:
            raise ValueError(f"chunk {name}: {size} bytes are not whole tokens of this layout")
        counts.append(m)
    if sum(counts) > n:
        raise ValueError(f"chunks hold {sum(counts)} tokens, the plan {n}")
    counts.append(n - sum(counts))  # the tail's cells
    starts = [sum(counts[:i]) for i in range(len(counts))]

    fixed: list[tuple[int, bytes]] = []
    columns: list[list[Place]] = []  # per part: each range's place

    def runs(pos: int, per: int) -> list[Place]:
        return [Place(pos + per * a, per * m) for a, m in zip(starts, counts, strict=True)]

    fixed.append((0, struct.pack("<III", BASE_MAGIC, int(plan["state_version"]), n)))
    pos = 12
    columns.append(runs(pos, 4))
    pos += 4 * n
    fixed.append((pos, _U32.pack(1) + _U32.pack(n)))
    pos += 8
    columns.append(runs(pos, layout.cell_bytes))
    pos += layout.cell_bytes * n
    fixed.append((pos, _U32.pack(layout.v_trans) + _U32.pack(len(layout.k))))
    pos += 8
    for t, row in layout.k:
        fixed.append((pos, TYPE_ROW.pack(t, row)))
        pos += TYPE_ROW.size
        columns.append(runs(pos, row))
        pos += row * n
    for t, size, n_embd in layout.v:
        if layout.v_trans:
            fixed.append((pos, TYPE_EL.pack(t, size, n_embd)))
            pos += TYPE_EL.size
            columns.append(
                [
                    Place(pos + size * a, size * m, n_embd, size * n)
                    for a, m in zip(starts, counts, strict=True)
                ]
            )
            pos += size * n_embd * n
        else:
            fixed.append((pos, TYPE_ROW.pack(t, size)))
            pos += TYPE_ROW.size
            columns.append(runs(pos, size))
            pos += size * n
    size = int(plan["size"])
    if not pos + TRAILER_SIZE <= size <= _MAX_SIZE:
        raise ValueError(f"its KV cache ends at {pos}, its file of {size} bytes needs more after it")
    seq = _I32.pack(int(plan["seq_id"])) if "seq_id" in plan else None
    ranges = tuple(tuple(col[r] for col in columns) for r in range(len(counts)))
    return KvPlacement(tuple(fixed), ranges, pos, size, layout.cell_bytes, seq)


def check_parts(parts: Sequence[memoryview], places: Sequence[Place], what: str) -> None:
    """:class:`SlotFileError` (``bad_layout``) unless a piece's parts fill its places exactly."""
    if len(parts) != len(places):
        raise SlotFileError("bad_layout", f"{what}: {len(parts)} parts, its place has {len(places)}")
    for i, (part, place) in enumerate(zip(parts, places, strict=True)):
        if len(part) != place.nbytes:
            raise SlotFileError(
                "bad_layout", f"{what}: part {i} is {len(part)} bytes, its place {place.nbytes}"
            )

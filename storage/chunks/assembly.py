"""The v1 file a manifest's plan describes, written from its pieces (effectful: files, threads).

:func:`write_file` writes it from every piece at once; :class:`PlacedFile` takes the KV pieces as
they arrive, each into the places :mod:`storage.chunks.placement` gives (a restore holds a few
pieces, not the state), and the part after the KV cache from the tail and the checkpoints.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import zlib
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from storage.chunks.chunking import unpack_parts, with_body_crc, write_v1, write_v1_after_kv
from storage.chunks.placement import KvPlacement, check_parts
from storage.errors import ChecksumError, SlotFileError


def write_file(
    path: Path, plan: Mapping[str, Any], objects: Mapping[str, bytes], verify: bool = True
) -> tuple[int, int]:
    """The assembled file and its (size, crc32). The bytes are gathered as views of the pieces,
    then written by a few threads at their offsets; with ``verify`` another thread computes the CRC
    meanwhile (both release the GIL), so a restore costs about the slower of the two, not their
    sum. Without ``verify`` no CRC is computed (0 is returned for it): the trailer carries the
    original's body CRC and the reader checks the bytes (the engine does, as it loads them), and a
    transposed V cache is interleaved from its chunks while being written instead of joined into a
    copy first. A plan without ``body_crc32`` (a cut, an old manifest) always gets the CRC: its
    trailer is written last, once the CRC is known. Not fsynced: it is a cache the engine loads at
    once, and a file a crash damaged fails its CRC there and is fetched again."""
    known = "body_crc32" in plan
    segments = Segments(columns=known and not verify)  # the CRC reads joined parts in file order
    size, _ = write_v1(segments, plan if known else {**plan, "body_crc32": 0}, objects, checksum=False)
    pool = threads()
    with open(path, "xb") as f:
        os.ftruncate(f.fileno(), size)
        crc = pool.submit(_crc, segments.parts[:-1]) if verify or not known else None  # the trailer: last
        for done in [pool.submit(_pwrite, f.fileno(), group) for group in segments.groups(_WRITERS)]:
            done.result()
        if crc is None:
            return size, 0
        body = crc.result()
        offset, last = segments.parts[-1]
        assert isinstance(last, memoryview)
        if not known:
            last = memoryview(with_body_crc(last, body))
            _pwrite_all(f.fileno(), last, offset)
    if known and body != int(plan["body_crc32"]):  # the trailer took the plan's word for it: check it
        raise ChecksumError(
            f"{path.name}: body crc32 {body:08x}, the manifest says {int(plan['body_crc32']):08x}"
        )
    return size, zlib.crc32(last, body)


_WRITERS = 4
_CRC_BLOCK = 8 << 20
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14
_ROWS_BYTES = 1 << 20  # a transposed V is written through a buffer of about this many bytes of rows
_writers: ThreadPoolExecutor | None = None
_writers_made = threading.Lock()
_scratch = threading.local()


def threads() -> ThreadPoolExecutor:
    """The assembly threads, started once per process (their row buffers stay warm between
    restores; concurrent restores share them)."""
    global _writers
    with _writers_made:
        if _writers is None:
            _writers = ThreadPoolExecutor(max_workers=_WRITERS + 1, thread_name_prefix="slotkeeper-assemble")
        return _writers


@dataclass(frozen=True)
class _Columns:
    """Column blocks (rows × their width each) written side by side, row after row."""

    cols: tuple[np.ndarray, ...]
    rows: int
    width: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.width


class Segments:
    """A ``write`` target that keeps what it is given, with offsets (no copy)."""

    def __init__(self, columns: bool, start: int = 0) -> None:
        self.parts: list[tuple[int, memoryview | _Columns]] = []
        self.n = start
        self.columns = columns  # False: write_v1 joins column blocks into one part first

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self.parts.append((self.n, view))
        self.n += len(view)

    def write_columns(self, cols: list[np.ndarray]) -> int:
        rows = cols[0].shape[0] if cols else 0
        part = _Columns(tuple(cols), rows, sum(c.shape[1] for c in cols))
        self.parts.append((self.n, part))
        self.n += part.nbytes
        return part.nbytes

    def groups(self, k: int) -> list[list[tuple[int, memoryview | _Columns]]]:
        """The parts in ``k`` runs of about equal bytes (a column part split by rows)."""
        out: list[list[tuple[int, memoryview | _Columns]]] = [[] for _ in range(k)]
        share = max(1, self.n // k + 1)
        for offset, part in self.parts:
            if isinstance(part, _Columns) and part.rows > 1:
                step = max(1, -(-part.rows // k))
                for r in range(0, part.rows, step):
                    rows = min(step, part.rows - r)
                    piece = _Columns(tuple(c[r : r + rows] for c in part.cols), rows, part.width)
                    at = offset + r * part.width
                    out[min(at // share, k - 1)].append((at, piece))
                continue
            out[min(offset // share, k - 1)].append((offset, part))
        return out


def _crc(parts: list[tuple[int, memoryview | _Columns]]) -> int:
    crc = 0
    for _, view in parts:
        assert isinstance(view, memoryview)
        crc = zlib.crc32(view, crc)
    return crc


def _pwrite(fd: int, parts: list[tuple[int, memoryview | _Columns]]) -> None:
    for offset, part in parts:
        if isinstance(part, _Columns):
            _pwrite_columns(fd, part, offset)
        else:
            _pwrite_all(fd, part, offset)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _pwrite_columns(fd: int, part: _Columns, offset: int) -> None:
    """Rows of the joined columns, built a batch at a time in this thread's buffer and written."""
    if not part.nbytes:
        return
    batch = max(1, min(part.rows, _ROWS_BYTES // part.width))
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < batch * part.width:
        buf = _scratch.buf = np.empty(max(batch * part.width, _ROWS_BYTES), dtype=np.uint8)
    for r in range(0, part.rows, batch):
        rows = min(batch, part.rows - r)
        out = buf[: rows * part.width].reshape(rows, part.width)
        at = 0
        for c in part.cols:
            w = c.shape[1]
            out[:, at : at + w] = c[r : r + rows]
            at += w
        _pwrite_all(fd, memoryview(out.data).cast("B"), offset + r * part.width)


class PlacedFile:
    """A v1 file written as its pieces arrive: the KV pieces a window at a time, each into its
    places (:meth:`place_window`), and the rest from the tail and the checkpoints
    (:meth:`write_rest`), then :meth:`checksum`. Owned by the one restore that creates it, which
    calls :meth:`close` in the end whatever happened.

    A transposed V layer interleaves every piece in each of its rows, so its pieces are copied
    into a shared map of the file (:meth:`prepare` makes its pages at once); everything else is
    written with ``pwrite``."""

    def __init__(self, path: Path, placement: KvPlacement) -> None:
        self.placement = placement
        self._state = threading.Lock()
        self._writers, self._closing = 0, False
        self._trailer: tuple[int, bytes] | None = None  # its offset and bytes, once written
        self._map: mmap.mmap | None = None
        self._rows: np.ndarray | None = None  # the map's bytes, from file offset self._mapped
        self._mapped = 0
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            os.ftruncate(self.fd, placement.size)
            for offset, data in placement.fixed:
                _pwrite_all(self.fd, memoryview(data), offset)
            rows = [p.offset for r in placement.ranges for p in r if p.rows > 1]
            if rows:
                self._mapped = min(rows) // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
                self._map = mmap.mmap(self.fd, placement.end - self._mapped, offset=self._mapped)
                self._rows = np.frombuffer(self._map, dtype=np.uint8)
        except BaseException:
            self.close()
            raise

    def prepare(self) -> None:
        """The mapped pages made (while the pieces are on their way): one fault per page, taken
        by the copies instead, would cost more than the copies."""
        with self._busy():
            if self._map is not None:
                with contextlib.suppress(OSError):  # a kernel without it: a fault per page
                    self._map.madvise(_MADV_POPULATE_WRITE)

    def place_window(self, first: int, pieces: Sequence[tuple[bytes, str, int]], verify: bool) -> None:
        """The pieces (data, what it is, the CRC in its name) of consecutive ranges from ``first``
        on, each written into its places, several at once."""
        with self._busy():
            for done in [
                threads().submit(self._place, first + k, *piece, verify) for k, piece in enumerate(pieces)
            ]:
                done.result()

    def _place(self, r: int, data: bytes, what: str, named_crc: int, verify: bool) -> None:
        for part, place in zip(
            self._parts(r, data, what, named_crc, verify), self.placement.ranges[r], strict=True
        ):
            if not place.nbytes:
                continue  # (a range of no tokens: the tail's, when the last chunk ends the state)
            if place.rows == 1:
                _pwrite_all(self.fd, part, place.offset)
                continue
            assert self._rows is not None
            rows = np.lib.stride_tricks.as_strided(  # inside the map: every place ends by placement.end
                self._rows[place.offset - self._mapped :],
                shape=(place.rows, place.width),
                strides=(place.stride, 1),
            )
            rows[:] = np.frombuffer(part, dtype=np.uint8).reshape(place.rows, place.width)

    def _parts(self, r: int, data: bytes, what: str, named_crc: int, verify: bool) -> list[memoryview]:
        """Range ``r``'s piece as the parts its places take (the cells with the plan's sequence
        id). ``verify``: its bytes are checked against the CRC in its name first; a piece whose
        framing does not fit is checked then in any case, so that damage is named as such
        (:class:`ChecksumError`) and only a piece that really is what it is named gives
        :class:`SlotFileError`."""
        if verify and zlib.crc32(data) != named_crc:
            raise ChecksumError(f"{what}: its bytes do not match the CRC in its name")
        places = self.placement.ranges[r]
        try:
            parts = unpack_parts(data, what)
            check_parts(parts, places, what)
        except SlotFileError as exc:
            if zlib.crc32(data) != named_crc:
                raise ChecksumError(f"{what}: its bytes do not match the CRC in its name") from exc
            raise
        if self.placement.seq is not None and parts[1]:
            cells = np.frombuffer(parts[1], dtype=np.uint8).reshape(-1, self.placement.cell_bytes).copy()
            cells[:, -4:] = np.frombuffer(self.placement.seq, dtype=np.uint8)
            parts[1] = memoryview(cells.data).cast("B")
        return parts

    def write_rest(self, plan: Mapping[str, Any], objects: Mapping[str, bytes]) -> None:
        """What follows the KV cache, from the tail and the checkpoints in ``objects`` (while the
        KV pieces are placed, if need be: the places never meet)."""
        with self._busy():
            known = "body_crc32" in plan
            rest = Segments(columns=False, start=self.placement.end)
            size = write_v1_after_kv(
                rest, plan if known else {**plan, "body_crc32": 0}, objects, self.placement.end
            )
            if size != self.placement.size:
                raise SlotFileError(
                    "bad_layout", f"the pieces make {size} bytes, the plan {self.placement.size}"
                )
            for done in [threads().submit(_pwrite, self.fd, group) for group in rest.groups(_WRITERS)]:
                done.result()
            offset, trailer = rest.parts[-1]
            assert isinstance(trailer, memoryview)
            self._trailer = (offset, bytes(trailer))

    def checksum(self, plan: Mapping[str, Any], verify: bool) -> int:
        """Once every part is written: the file's CRC-32, computed (by reading the file back) when
        asked to verify or when the plan records no body CRC (an old manifest: the trailer is
        written again with it); 0 otherwise. :class:`ChecksumError` when the body's CRC is not
        the plan's."""
        with self._busy():
            known = "body_crc32" in plan
            if not verify and known:
                return 0
            assert self._trailer is not None, "checksum before write_rest"
            offset, trailer = self._trailer
            body = _file_crc(self.fd, offset)
            if not known:
                trailer = with_body_crc(trailer, body)
                _pwrite_all(self.fd, memoryview(trailer), offset)
            elif body != int(plan["body_crc32"]):
                raise ChecksumError(f"body crc32 {body:08x}, the manifest says {int(plan['body_crc32']):08x}")
            return zlib.crc32(trailer, body)

    @contextlib.contextmanager
    def _busy(self) -> Iterator[None]:
        with self._state:
            if self._closing:
                raise SlotFileError("truncated", "the restore writing this file has ended")
            self._writers += 1
        try:
            yield
        finally:
            with self._state:
                self._writers -= 1
                if self._closing and not self._writers:
                    self._close()

    def close(self) -> None:
        """Now, or as soon as the writes under way are done (a restore that ended while its
        threads write: the descriptor is never closed under them, nor its number reused).
        Never waits."""
        with self._state:
            self._closing = True
            if not self._writers:
                self._close()

    def _close(self) -> None:
        self._rows = None  # (a map cannot close while an array exports it)
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view a traceback still holds: closed when freed
                self._map.close()
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _file_crc(fd: int, end: int) -> int:
    crc, at = 0, 0
    while at < end:
        block = os.pread(fd, min(_CRC_BLOCK, end - at), at)
        if not block:
            raise SlotFileError("truncated", f"the file ends at {at}, before {end}")
        crc, at = zlib.crc32(block, crc), at + len(block)
    return crc

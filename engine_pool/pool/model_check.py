"""Is a file a model an engine can load? A cheap check of a GGUF's header, before any engine starts.

`model_problem(path)` says in a few words what is wrong with a model file — it does not exist, is a
directory or not a regular file, cannot be read, is not a GGUF file, has a GGUF version llama.cpp
does not read, has a truncated or implausible header, or is shorter than its own tensor table says
(an interrupted download) — or returns None. `gguf_problem` is the same verdict over an open
stream; it walks the fixed header, the key/value section and the tensor table without keeping any
value, and never reads tensor data, so a multi-GB model costs a few reads of its first megabytes.
A model that passes can still fail in llama.cpp (an architecture this build does not know, bad
hyperparameters): the engine says so in its log, and the supervisor reports it.

Its uses at the edges: `slotkeeper serve` and `slotkeeper node` refuse to start with one line per
bad model (`check_models`), and the supervisor checks the file again before every spawn, since a
file can go away while a node runs.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Iterable
from typing import BinaryIO

from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUFValueType
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

_MAGIC = struct.pack("<I", GGUF_MAGIC)  # b"GGUF"
_FIXED: dict[int, int] = {
    GGUFValueType.UINT8: 1,
    GGUFValueType.INT8: 1,
    GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2,
    GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4,
    GGUFValueType.INT32: 4,
    GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8,
    GGUFValueType.INT64: 8,
    GGUFValueType.FLOAT64: 8,
}
_MAX_DIMS = 4  # GGML_MAX_DIMS
# The smallest a key/value pair (empty key, u32 type, one byte) and a tensor entry (empty name,
# u32 n_dims, one u64 dim, u32 type, u64 offset) can be: counts beyond what the file could hold
# are garbage, found before walking them.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8
# Far above any published model (thousands of tensors, a few dozen keys): beyond them the header is
# garbage behind a valid magic, not a model.
_MAX_TENSORS = 1 << 20
_MAX_KEYS = 1 << 16


class _Bad(Exception):
    """What is wrong, in words that follow the path."""


class _Cursor:
    """Reads forward through a stream of known size; reading past the end is a truncated header."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f, self.size, self.pos = f, size, 0

    @property
    def left(self) -> int:
        return self.size - self.pos

    def _need(self, n: int, what: str) -> None:
        if n > self.left:
            raise _Bad(f"has a truncated GGUF header ({what} runs past the end of its {self.size} bytes)")

    def read(self, n: int, what: str) -> bytes:
        self._need(n, what)
        data = self.f.read(n)
        if len(data) != n:
            raise _Bad(f"has a truncated GGUF header ({what} runs past the end of its {self.size} bytes)")
        self.pos += n
        return data

    def skip(self, n: int, what: str) -> None:
        self._need(n, what)
        self.pos += n
        self.f.seek(self.pos)

    def u32(self, what: str) -> int:
        return int(struct.unpack("<I", self.read(4, what))[0])

    def u64(self, what: str) -> int:
        return int(struct.unpack("<Q", self.read(8, what))[0])

    def string(self, what: str) -> bytes:
        return self.read(self.u64(what), what)


def _skip_value(cur: _Cursor, vtype: int, key: str) -> None:
    what = f"the value of {key!r}"
    if vtype in _FIXED:
        cur.skip(_FIXED[vtype], what)
    elif vtype == GGUFValueType.STRING:
        cur.skip(cur.u64(what), what)
    elif vtype == GGUFValueType.ARRAY:
        itype, n = cur.u32(what), cur.u64(what)
        if itype in _FIXED:
            cur.skip(n * _FIXED[itype], what)
        elif itype == GGUFValueType.STRING:
            cur._need(n * 8, what)  # each item has at least its length: bounds the loop
            for _ in range(n):
                cur.skip(cur.u64(what), what)
        else:
            raise _Bad(f"is a damaged GGUF file (key {key!r} is an array of unsupported type {itype})")
    else:
        raise _Bad(f"is a damaged GGUF file (key {key!r} has unknown value type {vtype})")


def gguf_problem(f: BinaryIO, size: int) -> str | None:
    """What is wrong with the GGUF in the stream `f` of `size` bytes, or None. Reads the header and
    the tensor table only; checks that the file holds the tensor data the table describes."""
    try:
        _walk(f, size)
    except _Bad as exc:
        return str(exc)
    return None


def tensor_types(path: str) -> set[int]:
    """The ggml types (`gguf.GGMLQuantizationType` values) of the model's tensors, from its header
    alone; empty when the file is no readable GGUF (loading it then fails and says why)."""
    try:
        with open(path, "rb", buffering=1 << 16) as f:
            return _walk(f, os.fstat(f.fileno()).st_size)
    except (OSError, _Bad):
        return set()


def _walk(f: BinaryIO, size: int) -> set[int]:
    """Walks the header and the tensor table; the tensors' types, or _Bad saying what is wrong."""
    if size == 0:
        raise _Bad("is empty, not a GGUF file")
    cur = _Cursor(f, size)
    types: set[int] = set()
    head = f.read(4)
    if head != _MAGIC:
        raise _Bad(f"is not a GGUF file (it starts with {head!r}, not {_MAGIC!r})")
    cur.pos = 4
    version = cur.u32("the version")
    if version not in READER_SUPPORTED_VERSIONS:
        swapped = struct.unpack("<I", struct.pack(">I", version))[0]
        if swapped in READER_SUPPORTED_VERSIONS:
            raise _Bad("is a big-endian GGUF file (this machine reads little-endian ones)")
        supported = ", ".join(str(v) for v in READER_SUPPORTED_VERSIONS)
        raise _Bad(f"is GGUF version {version}, which llama.cpp does not read (it reads {supported})")
    n_tensors, n_kv = cur.u64("the tensor count"), cur.u64("the key count")
    if n_tensors > _MAX_TENSORS or n_kv > _MAX_KEYS:
        raise _Bad(f"has an implausible GGUF header ({n_tensors} tensors, {n_kv} keys)")
    if n_tensors * _MIN_TENSOR_BYTES + n_kv * _MIN_KV_BYTES > cur.left:
        fit = f"{n_tensors} tensors and {n_kv} keys cannot fit in {size} bytes"
        raise _Bad(f"has a truncated GGUF header ({fit})")
    alignment = GGUF_DEFAULT_ALIGNMENT
    for i in range(n_kv):
        key = cur.string(f"key {i}").decode("utf-8", "replace")
        vtype = cur.u32(f"the type of {key!r}")
        if key == "general.alignment" and vtype == GGUFValueType.UINT32:
            alignment = cur.u32(f"the value of {key!r}")
            if alignment == 0 or alignment & (alignment - 1):
                raise _Bad(f"is a damaged GGUF file (general.alignment is {alignment}, not a power of two)")
        else:
            _skip_value(cur, vtype, key)
    data_end = 0
    for i in range(n_tensors):
        name = cur.string(f"the name of tensor {i}").decode("utf-8", "replace")
        n_dims = cur.u32(f"tensor {name!r}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise _Bad(f"is a damaged GGUF file (tensor {name!r} has {n_dims} dimensions)")
        elements = 1
        dims = [cur.u64(f"tensor {name!r}") for _ in range(n_dims)]
        for d in dims:
            elements *= d
        ttype, offset = cur.u32(f"tensor {name!r}"), cur.u64(f"tensor {name!r}")
        sizes = GGML_QUANT_SIZES.get(ttype)  # type: ignore[call-overload]
        if sizes is None:
            raise _Bad(f"is a damaged GGUF file (tensor {name!r} has unknown type {ttype})")
        block, type_size = sizes
        if dims[0] % block:
            raise _Bad(f"is a damaged GGUF file (tensor {name!r}: {dims[0]} is not a multiple of {block})")
        types.add(ttype)
        data_end = max(data_end, offset + elements // block * type_size)
    data_start = -(-cur.pos // alignment) * alignment
    if data_start + data_end > size:
        raise _Bad(
            f"is truncated: its tensors end at byte {data_start + data_end}, the file has {size} "
            "bytes (an interrupted download?)"
        )
    return types


def model_problem(path: str) -> str | None:
    """What is wrong with the model file at `path`, in words that follow the path, or None.
    Never opens anything but a regular file (a FIFO would block the reader)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "does not exist"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if stat.S_ISDIR(st.st_mode):
        return "is a directory, not a GGUF file"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    try:
        with open(path, "rb", buffering=1 << 16) as f:
            return gguf_problem(f, st.st_size)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"


def check_models(paths: Iterable[str]) -> list[str]:
    """One line per bad model file, naming it and what is wrong (empty: all of them pass)."""
    return [f"model {path}: {problem}" for path in paths if (problem := model_problem(path)) is not None]

"""The slot-file format v1 on disk (native/SLOTFILE.md is authoritative): constants and parsers.

Each parser reads one part of an open file through a :class:`Section`, a cursor that never reads
past its section's end: every length is checked against the bytes left before anything is read
or allocated, so a corrupt count or length costs an error, never memory. Error kinds:

* ``truncated`` — smaller than a trailer, no trailer at the end of a file that starts like a slot
  file, or a length (in the trailer or inside a section) that runs past its end;
* ``bad_magic`` / ``unsupported_version`` — wrong magic, trailer major != 1, SCKP/SKMD version != 1,
  META ``format`` != 1, or a llama state version the caller does not accept;
* ``checksum_mismatch`` — the trailer's own CRC (the body CRC is checked by the reader);
* ``bad_layout`` — sections not contiguous, unexplained bytes in a section, checkpoints out of
  order or past the base token count, malformed META, counts or logits that disagree;
* ``too_large`` — a META record over the caller's cap.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Collection
from typing import Any, NamedTuple

from storage.errors import SlotFileError

TRAILER = struct.Struct("<8sHHIQQQQQII")
TRAILER_SIZE = TRAILER.size  # 64
TRAILER_MAGIC = b"SLOTKEEP"
FORMAT_MAJOR = 1
BASE_MAGIC = 0x67677371  # 'ggsq'
CKPT_MAGIC = 0x504B4353  # 'SCKP'
META_MAGIC = 0x444D4B53  # 'SKMD'
SECTION_VERSION = 1
STATE_VERSIONS = frozenset({3})
TAG_META, TAG_LAST_LOGITS, TAG_CKPT_LOGITS = 1, 2, 3
MAX_META_BYTES = 16 << 20

_U32X3 = struct.Struct("<III")
_CKPT_HEAD = struct.Struct("<qii")
_U64 = struct.Struct("<Q")
_RECORD_HEAD = struct.Struct("<IIQ")
_MIN_CKPT = _CKPT_HEAD.size + 3 * _U64.size


class Checkpoint(NamedTuple):
    n_tokens: int
    pos_min: int
    pos_max: int
    target_bytes_len: int
    draft_bytes_len: int
    spec_bytes_len: int
    target_offset: int  # absolute file offset of the target state bytes


class Record(NamedTuple):
    tag: int
    flags: int
    offset: int  # absolute file offset of the payload
    length: int
    ckpt_index: int | None = None  # CKPT_LOGITS only: the checkpoint it belongs to


class Section:
    """A bounded cursor over ``[start, end)`` of an open file; reads never pass ``end``."""

    def __init__(self, fd: int, name: str, start: int, end: int) -> None:
        self.fd, self.name, self.pos, self.end = fd, name, start, end

    def need(self, n: int, what: str) -> None:
        if n > self.end - self.pos:
            raise SlotFileError(
                "truncated",
                f"{self.name}: {what} needs {n} bytes but {self.end - self.pos} are left",
                offset=self.pos,
            )

    def read(self, n: int, what: str) -> bytes:
        self.need(n, what)
        data = os.pread(self.fd, n, self.pos)
        if len(data) != n:
            raise SlotFileError(
                "truncated", f"{self.name}: file shrank while reading {what}", offset=self.pos
            )
        self.pos += n
        return data

    def unpack(self, st: struct.Struct, what: str) -> tuple[Any, ...]:
        return st.unpack(self.read(st.size, what))

    def skip(self, n: int, what: str) -> int:
        self.need(n, what)
        start = self.pos
        self.pos += n
        return start

    def finish(self) -> None:
        if self.pos != self.end:
            raise SlotFileError(
                "bad_layout",
                f"{self.name}: {self.end - self.pos} unexplained bytes at its end",
                offset=self.pos,
            )


def read_trailer(fd: int, size: int) -> tuple[Any, ...]:
    """The unpacked trailer fields, after its magic, CRC and major version are checked."""
    if size < TRAILER_SIZE:
        raise SlotFileError(
            "truncated", f"file is {size} bytes, smaller than the {TRAILER_SIZE}-byte trailer"
        )
    raw = os.pread(fd, TRAILER_SIZE, size - TRAILER_SIZE)
    if len(raw) != TRAILER_SIZE:
        raise SlotFileError("truncated", "file shrank while reading the trailer")
    if raw[:8] != TRAILER_MAGIC:
        # A magic within two bytes of SLOTKEEP is a damaged trailer; anything else at the end of a
        # file that starts with 'ggsq' means the trailer is gone: the file was cut short.
        near_miss = sum(a != b for a, b in zip(raw[:8], TRAILER_MAGIC, strict=True)) <= 2
        if not near_miss and os.pread(fd, 4, 0) == BASE_MAGIC.to_bytes(4, "little"):
            raise SlotFileError(
                "truncated", "no SLOTKEEP trailer at the end of a file that starts like a slot file"
            )
        raise SlotFileError(
            "bad_magic", f"trailer magic {raw[:8]!r} is not {TRAILER_MAGIC!r}", offset=size - 64
        )
    fields = TRAILER.unpack(raw)
    if zlib.crc32(raw[:60]) != fields[-1]:
        raise SlotFileError(
            "checksum_mismatch", f"trailer crc32 {zlib.crc32(raw[:60]):08x} != stored {fields[-1]:08x}"
        )
    if fields[1] != FORMAT_MAJOR:
        raise SlotFileError(
            "unsupported_version", f"format major {fields[1]}, this reader reads {FORMAT_MAJOR}"
        )
    return fields


def check_layout(
    size: int, base_len: int, ckpt_off: int, ckpt_len: int, meta_off: int, meta_len: int
) -> None:
    """Sections are contiguous and end where the trailer starts (checked before any is read)."""
    body_end = size - TRAILER_SIZE
    for name, end in (
        ("base", base_len),
        ("checkpoints", ckpt_off + ckpt_len),
        ("metadata", meta_off + meta_len),
    ):
        if end > body_end:
            raise SlotFileError("truncated", f"trailer puts the {name} section end at {end}, past {body_end}")
    if (ckpt_off == 0) != (ckpt_len == 0):
        raise SlotFileError("bad_layout", f"checkpoint section offset {ckpt_off} with length {ckpt_len}")
    if ckpt_len and ckpt_off != base_len:
        raise SlotFileError(
            "bad_layout", f"checkpoint section at {ckpt_off}, base payload ends at {base_len}"
        )
    expected_meta = ckpt_off + ckpt_len if ckpt_len else base_len
    if meta_off != expected_meta:
        raise SlotFileError("bad_layout", f"metadata section at {meta_off}, expected {expected_meta}")
    if meta_off + meta_len != body_end:
        raise SlotFileError(
            "bad_layout", f"metadata section ends at {meta_off + meta_len}, trailer at {body_end}"
        )


def read_base(fd: int, base_len: int, state_versions: Collection[int]) -> tuple[int, int]:
    sec = Section(fd, "base payload", 0, base_len)
    magic, version, n_tokens = sec.unpack(_U32X3, "header")
    if magic != BASE_MAGIC:
        raise SlotFileError("bad_magic", f"base payload magic {magic:#010x} is not 'ggsq'", offset=0)
    if version not in state_versions:
        raise SlotFileError(
            "unsupported_version", f"llama state version {version}, readable: {sorted(state_versions)}"
        )
    sec.skip(4 * n_tokens, f"{n_tokens} tokens")
    return version, n_tokens


def read_checkpoints(fd: int, start: int, length: int, base_tokens: int) -> tuple[Checkpoint, ...]:
    sec = Section(fd, "checkpoint section", start, start + length)
    magic, version, count = sec.unpack(_U32X3, "header")
    if magic != CKPT_MAGIC:
        raise SlotFileError(
            "bad_magic", f"checkpoint section magic {magic:#010x} is not 'SCKP'", offset=start
        )
    if version != SECTION_VERSION:
        raise SlotFileError("unsupported_version", f"checkpoint section version {version}", offset=start + 4)
    sec.need(count * _MIN_CKPT, f"{count} checkpoints")
    out: list[Checkpoint] = []
    previous = 0
    for i in range(count):
        n, pos_min, pos_max = sec.unpack(_CKPT_HEAD, f"checkpoint {i}")
        if not previous <= n <= base_tokens:
            raise SlotFileError(
                "bad_layout", f"checkpoint {i} covers {n} tokens (previous {previous}, base {base_tokens})"
            )
        previous = n
        lengths, offsets = [], []
        for blob in ("target", "draft", "speculative"):
            (blob_len,) = sec.unpack(_U64, f"checkpoint {i} {blob} length")
            offsets.append(sec.skip(blob_len, f"checkpoint {i} {blob} state"))
            lengths.append(blob_len)
        out.append(Checkpoint(n, pos_min, pos_max, lengths[0], lengths[1], lengths[2], offsets[0]))
    sec.finish()
    return tuple(out)


def read_meta_section(
    fd: int, start: int, length: int, max_meta: int
) -> tuple[tuple[Record, ...], dict[str, Any]]:
    sec = Section(fd, "metadata section", start, start + length)
    magic, version, n_records = sec.unpack(_U32X3, "header")
    if magic != META_MAGIC:
        raise SlotFileError("bad_magic", f"metadata section magic {magic:#010x} is not 'SKMD'", offset=start)
    if version != SECTION_VERSION:
        raise SlotFileError("unsupported_version", f"metadata section version {version}", offset=start + 4)
    sec.need(n_records * _RECORD_HEAD.size, f"{n_records} records")
    records: list[Record] = []
    meta: dict[str, Any] | None = None
    for i in range(n_records):
        tag, flags, rec_len = sec.unpack(_RECORD_HEAD, f"record {i} header")
        if tag == TAG_META:
            if meta is not None:
                raise SlotFileError("bad_layout", "more than one META record", offset=sec.pos - 16)
            sec.need(rec_len, "META record")
            if rec_len > max_meta:
                raise SlotFileError("too_large", f"META record is {rec_len} bytes, the limit is {max_meta}")
            offset = sec.pos
            meta = parse_meta(sec.read(rec_len, "META record"), offset)
        elif tag == TAG_CKPT_LOGITS:
            offset = sec.pos
            if rec_len < 4:
                raise SlotFileError(
                    "bad_layout", f"CKPT_LOGITS record of {rec_len} bytes has no index", offset=offset
                )
            (index,) = struct.unpack("<I", sec.read(4, "CKPT_LOGITS index"))
            sec.skip(rec_len - 4, f"record {i} payload")
            records.append(Record(tag, flags, offset, rec_len, index))
            continue
        else:
            offset = sec.skip(rec_len, f"record {i} payload")
        records.append(Record(tag, flags, offset, rec_len))
    sec.finish()
    return tuple(records), meta if meta is not None else {}


def parse_meta(raw: bytes, offset: int) -> dict[str, Any]:
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise SlotFileError("bad_layout", f"META record is not UTF-8 JSON: {exc}", offset=offset) from exc
    if not isinstance(meta, dict):
        raise SlotFileError(
            "bad_layout", f"META record is a JSON {type(meta).__name__}, not an object", offset=offset
        )
    if meta.get("format", 1) != 1:
        raise SlotFileError("unsupported_version", f"META format {meta.get('format')!r}", offset=offset)
    return meta


def cross_check(
    meta: dict[str, Any], records: tuple[Record, ...], ckpts: tuple[Checkpoint, ...], n: int
) -> None:
    if "n_tokens" in meta and meta["n_tokens"] != n:
        raise SlotFileError("bad_layout", f"META says {meta['n_tokens']!r} tokens, base payload has {n}")
    listed = meta.get("checkpoints")
    if isinstance(listed, list) and len(listed) != len(ckpts):
        raise SlotFileError("bad_layout", f"META lists {len(listed)} checkpoints, section has {len(ckpts)}")
    model = meta.get("model")
    n_vocab = model.get("n_vocab") if isinstance(model, dict) else None
    for rec in records:
        if rec.tag == TAG_LAST_LOGITS:
            floats = rec.length
        elif rec.tag == TAG_CKPT_LOGITS:
            index = rec.ckpt_index if rec.ckpt_index is not None else -1
            if not 0 <= index < len(ckpts):
                raise SlotFileError("bad_layout", f"CKPT_LOGITS for checkpoint {index} of {len(ckpts)}")
            floats = rec.length - 4
        else:
            continue
        if floats % 4 or (isinstance(n_vocab, int) and floats != 4 * n_vocab):
            raise SlotFileError(
                "bad_layout", f"logits record of {floats} bytes for n_vocab {n_vocab}", offset=rec.offset
            )

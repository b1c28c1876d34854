"""Pure-Python reader and validator of slot files, format v1 (native/SLOTFILE.md is authoritative).

Validation runs from the end: the 64-byte trailer first, then the body CRC (streamed in 1 MiB
reads, never the whole file in memory), then each section (:mod:`storage.slotfile.format`). The only
payload ever loaded is the META JSON (capped); state blobs and logits are skipped by offset and
reported by offset and length. :func:`read_slot_file` describes a file (a body-CRC mismatch is a
verdict, not an exception, so ``slotkeeper inspect`` can still show it); :func:`verify_slot_file`
raises on any problem, and on ``model_mismatch`` / ``shape_mismatch`` / ``too_large`` when the
caller says what the file must fit.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from storage.checksum import crc32_combine, file_crc32
from storage.errors import SlotFileError
from storage.slotfile.format import (
    MAX_META_BYTES,
    STATE_VERSIONS,
    TAG_CKPT_LOGITS,
    TAG_LAST_LOGITS,
    TRAILER_SIZE,
    Checkpoint,
    Record,
    check_layout,
    cross_check,
    read_base,
    read_checkpoints,
    read_meta_section,
    read_trailer,
)

__all__ = [
    "Checkpoint",
    "Record",
    "SlotFile",
    "read_slot_file",
    "read_tokens",
    "verify_slot_file",
    "whole_file_crc32",
]


@dataclass(frozen=True)
class SlotFile:
    """What a slot file says about itself. ``sizes`` sums to ``size`` exactly."""

    path: str
    size: int
    format_major: int
    format_minor: int
    flags: int
    state_version: int
    n_tokens: int
    state_offset: int
    state_len: int
    base_len: int
    ckpt_offset: int
    ckpt_len: int
    meta_offset: int
    meta_len: int
    checkpoints: tuple[Checkpoint, ...]
    records: tuple[Record, ...]
    meta: dict[str, Any]
    sizes: dict[str, int]
    body_crc32: int
    computed_crc32: int | None  # None when the checksum was not computed
    checksum_ok: bool | None
    notes: tuple[str, ...] = field(default=())

    @property
    def model(self) -> dict[str, Any]:
        model = self.meta.get("model")
        return model if isinstance(model, dict) else {}

    @property
    def fingerprint(self) -> str | None:
        value = self.model.get("fingerprint")
        return value if isinstance(value, str) else None

    @property
    def arch(self) -> str | None:
        value = self.model.get("arch")
        return value if isinstance(value, str) else None


def read_slot_file(
    path: str | Path,
    *,
    checksum: bool = True,
    state_versions: Collection[int] = STATE_VERSIONS,
    max_meta_bytes: int = MAX_META_BYTES,
) -> SlotFile:
    """Parse and structurally validate a slot file.

    A body-CRC mismatch does not raise here (``checksum_ok`` is False) unless it also breaks the
    structure, in which case the ``checksum_mismatch`` is raised with the structural error as its
    cause. Use :func:`verify_slot_file` to raise on every problem.
    """
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        trailer = read_trailer(fd, size)
        _, major, minor, flags, base_len, ckpt_off, ckpt_len, meta_off, meta_len, body_crc, _ = trailer
        check_layout(size, base_len, ckpt_off, ckpt_len, meta_off, meta_len)
        computed = file_crc32(path, 0, size - TRAILER_SIZE) if checksum else None
        ok = None if computed is None else computed == body_crc
        try:
            state_version, n_tokens = read_base(fd, base_len, state_versions)
            checkpoints = read_checkpoints(fd, ckpt_off, ckpt_len, n_tokens) if ckpt_len else ()
            records, meta = read_meta_section(fd, meta_off, meta_len, max_meta_bytes)
            cross_check(meta, records, checkpoints, n_tokens)
        except SlotFileError as exc:
            if ok is False:
                raise SlotFileError(
                    "checksum_mismatch", f"body crc32 {computed:08x} != stored {body_crc:08x} ({exc})"
                ) from exc
            raise
    logits = sum(r.length for r in records if r.tag in (TAG_LAST_LOGITS, TAG_CKPT_LOGITS))
    sizes = {
        "base": base_len,
        "checkpoints": ckpt_len,
        "metadata": meta_len - logits,
        "logits": logits,
        "trailer": TRAILER_SIZE,
    }
    state_offset = 12 + 4 * n_tokens
    return SlotFile(
        path=str(path),
        size=size,
        format_major=major,
        format_minor=minor,
        flags=flags,
        state_version=state_version,
        n_tokens=n_tokens,
        state_offset=state_offset,
        state_len=base_len - state_offset,
        base_len=base_len,
        ckpt_offset=ckpt_off,
        ckpt_len=ckpt_len,
        meta_offset=meta_off,
        meta_len=meta_len,
        checkpoints=checkpoints,
        records=records,
        meta=meta,
        sizes=sizes,
        body_crc32=body_crc,
        computed_crc32=computed,
        checksum_ok=ok,
        notes=(f"trailer flags {flags:#x} ignored",) if flags else (),
    )


def verify_slot_file(
    path: str | Path,
    *,
    fingerprint: str | None = None,
    max_bytes: int | None = None,
    n_ctx_slot: int | None = None,
    kv_types: tuple[str, str] | None = None,
    state_versions: Collection[int] = STATE_VERSIONS,
) -> SlotFile:
    """Validate everything, checksum included, and optionally that the file fits a model and slot."""
    if max_bytes is not None:
        size = os.stat(path).st_size
        if size > max_bytes:
            raise SlotFileError("too_large", f"file is {size} bytes, the limit is {max_bytes}")
    sf = read_slot_file(path, state_versions=state_versions)
    if not sf.checksum_ok:
        raise SlotFileError("checksum_mismatch", f"body crc32 {sf.computed_crc32:08x} != {sf.body_crc32:08x}")
    if fingerprint is not None and sf.fingerprint != fingerprint:
        raise SlotFileError("model_mismatch", f"file model {sf.fingerprint} != loaded model {fingerprint}")
    if n_ctx_slot is not None and sf.n_tokens > n_ctx_slot:
        raise SlotFileError("shape_mismatch", f"{sf.n_tokens} tokens do not fit a {n_ctx_slot}-token slot")
    raw_context = sf.meta.get("context")
    context: dict[str, Any] = raw_context if isinstance(raw_context, dict) else {}
    if kv_types is not None and (context.get("type_k"), context.get("type_v")) != tuple(kv_types):
        raise SlotFileError(
            "shape_mismatch", f"KV types {context.get('type_k')}/{context.get('type_v')} != {kv_types}"
        )
    return sf


def whole_file_crc32(path: str | Path) -> int:
    """The CRC-32 of the whole file as its trailer claims it (body CRC combined with the trailer).

    O(1): reads only the trailer. Pass it to ``BlobStore.put_file(crc32=...)`` so that the upload
    proves the bytes it sent are the bytes the writer checksummed.
    """
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        fields = read_trailer(f.fileno(), size)
        raw = os.pread(f.fileno(), TRAILER_SIZE, size - TRAILER_SIZE)
    return crc32_combine(fields[-2], zlib.crc32(raw), TRAILER_SIZE)


def read_tokens(sf: SlotFile) -> list[int]:
    """The base payload's tokens (4·n_tokens bytes, bounded by the validated base length)."""
    with open(sf.path, "rb") as f:
        f.seek(12)
        data = f.read(4 * sf.n_tokens)
    if len(data) != 4 * sf.n_tokens:
        raise SlotFileError("truncated", "tokens end past the file", offset=12)
    return list(struct.unpack(f"<{sf.n_tokens}i", data))

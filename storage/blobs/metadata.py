"""The user metadata every slot-file object carries (see :mod:`storage.blobs.blobstore`): tenant,
session, generation, model fingerprint, token count, size, ``crc32:%08x`` of the whole object, the
routing digests, and the id of the write that produced it. All of it ASCII strings, as S3 user
metadata requires; the local store keeps the same mapping in a JSON file beside the object.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping

from storage.blobs.blobstore import BlobMeta, PutOptions
from storage.checksum import format_checksum, parse_checksum
from storage.errors import StorageError
from storage.ids import SlotRef
from storage.index.prefix_digests import STORED_ROUTES

_FINGERPRINT_MAX = 256


def encode_metadata(ref: SlotRef, opts: PutOptions, *, size: int, crc32: int, writer: str) -> dict[str, str]:
    """The object metadata (all ASCII strings, as S3 user metadata requires); ``crc32`` is the
    file's as sent, which ``opts.crc32`` only expects."""
    model, n_tokens, route = opts.model, opts.n_tokens, opts.route
    if not model.isascii() or len(model) > _FINGERPRINT_MAX or not model.isprintable():
        raise StorageError(f"model fingerprint must be printable ASCII of at most {_FINGERPRINT_MAX} chars")
    if n_tokens < 0:
        raise StorageError("n_tokens must be >= 0")
    if route and not STORED_ROUTES.fullmatch(route):
        raise StorageError(
            "route must be lowercase hex digests of 16..128 characters (route[.shared][+prompt][-head])"
        )
    md = {
        "tenant": ref.tenant,
        "session": ref.session,
        "generation": str(ref.generation),
        "model": model,
        "tokens": str(n_tokens),
        "size": str(size),
        "checksum": format_checksum(crc32),
        "writer": writer,
    }
    if route:
        md["route"] = route
    return md


def decode_metadata(
    ref: SlotRef, key: str, size: int, last_modified: float, etag: str, md: Mapping[str, str]
) -> BlobMeta:
    """Metadata as stored; identity always comes from the key, and must agree with the metadata."""
    for name, value in (
        ("tenant", ref.tenant),
        ("session", ref.session),
        ("generation", str(ref.generation)),
    ):
        if name in md and md[name] != value:
            raise StorageError(f"object {key}: metadata {name}={md[name]!r} disagrees with its key")
    crc = parse_checksum(md["checksum"]) if "checksum" in md else None
    try:
        n_tokens = int(md.get("tokens", "0"))
    except ValueError as exc:
        raise StorageError(f"object {key}: bad tokens metadata {md.get('tokens')!r}") from exc
    return BlobMeta(
        ref=ref,
        key=key,
        size=size,
        crc32=crc,
        model=md.get("model", ""),
        n_tokens=n_tokens,
        last_modified=last_modified,
        etag=etag,
        writer=md.get("writer", ""),
        route=md.get("route", "") if STORED_ROUTES.fullmatch(md.get("route", "")) else "",
    )


def new_writer_id() -> str:
    """A unique id stamped into each write, to tell our own object from a concurrent writer's."""
    return uuid.uuid4().hex

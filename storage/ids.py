"""Ids and blob keys: the single place where a tenant, session or engine id is validated.

An id becomes a path segment of a blob key (``{prefix}/{tenant}/{session}/{generation:020d}.slot``),
a directory name of the local store and spill cache, and a ``:``-separated part of a Redis key.
So the accepted alphabet excludes every separator of those three namespaces (``/``, ``\\``, ``:``),
``..``, a leading ``.``, NUL and whitespace, and ids are at most :data:`MAX_ID_LEN` characters.
Because no id contains a separator, a key can never be reinterpreted as another tenant's key.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass

from storage.errors import InvalidId

MAX_ID_LEN = 128
MAX_GENERATION = 10**20 - 1  # keys format the generation as exactly 20 digits
ID_ALPHABET = frozenset(string.ascii_letters + string.digits + "-_.~@+=")
_KEY_TAIL = re.compile(r"(?P<tenant>[^/]+)/(?P<session>[^/]+)/(?P<generation>[0-9]{20})\.slot")


def validate_id(value: object, what: str = "id") -> str:
    """Return ``value`` if it is a safe id, else raise :class:`InvalidId` naming the first problem."""
    if not isinstance(value, str):
        raise InvalidId(what, f"must be a string, not {type(value).__name__}")
    if not value:
        raise InvalidId(what, "is empty")
    if len(value) > MAX_ID_LEN:
        raise InvalidId(what, f"is {len(value)} characters long, the limit is {MAX_ID_LEN}")
    if "\0" in value:
        raise InvalidId(what, "contains a NUL character")
    if "/" in value or "\\" in value:
        raise InvalidId(what, "contains a path separator")
    if ".." in value:
        raise InvalidId(what, "contains '..'")
    if value.startswith("."):
        raise InvalidId(what, "starts with '.'")
    for ch in value:
        if ch not in ID_ALPHABET:
            raise InvalidId(what, f"contains {ch!r}; allowed are ASCII letters, digits and '-_.~@+='")
    return value


def validate_generation(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidId("generation", f"must be an int, not {type(value).__name__}")
    if not 0 <= value <= MAX_GENERATION:
        raise InvalidId("generation", f"{value} is outside 0..{MAX_GENERATION}")
    return value


def validate_prefix(prefix: str) -> str:
    """A blob-key prefix: empty, or ``/``-separated segments that are each valid ids."""
    if prefix == "":
        return prefix
    for segment in prefix.split("/"):
        validate_id(segment, "key prefix segment")
    return prefix


@dataclass(frozen=True, order=True)
class SlotRef:
    """One generation of one session of one tenant; validated on construction."""

    tenant: str
    session: str
    generation: int

    def __post_init__(self) -> None:
        validate_id(self.tenant, "tenant id")
        validate_id(self.session, "session id")
        validate_generation(self.generation)


def tenant_prefix(prefix: str, tenant: str, session: str | None = None) -> str:
    """The key prefix that holds exactly one tenant's (or one session's) objects, ending in ``/``."""
    parts = [validate_id(tenant, "tenant id")]
    if session is not None:
        parts.append(validate_id(session, "session id"))
    head = f"{prefix}/" if prefix else ""
    return head + "/".join(parts) + "/"


def blob_key(prefix: str, ref: SlotRef) -> str:
    return f"{tenant_prefix(prefix, ref.tenant, ref.session)}{ref.generation:020d}.slot"


def document_key(prefix: str, tenant: str, kind: str, name: str) -> str:
    """A small JSON document of one tenant (e.g. a stored response), ``{tenant}/.{kind}/{name}.json``.

    The folder starts with ``.``, which no session id may, so documents never share a name with a
    session's slot files and listings of slot files never see them.
    """
    folder = validate_id(kind, "document kind")
    return f"{tenant_prefix(prefix, tenant)}.{folder}/{validate_id(name, 'document id')}.json"


_NAME = re.compile(r"[0-9a-f]{16,128}(-[0-9a-f]{8})?")
PIECE_KINDS = frozenset({"kv", "ck"})


def manifest_key(prefix: str, ref: SlotRef, suffix: str = "manifest") -> str:
    """A generation's chunk manifest (``.manifest``) or tail (``.tail``) beside where its v1 slot
    file would be: ``{tenant}/{session}/{generation:020d}.{suffix}``."""
    if suffix not in ("manifest", "tail"):
        raise InvalidId("object suffix", f"{suffix!r} is not manifest or tail")
    return f"{tenant_prefix(prefix, ref.tenant, ref.session)}{ref.generation:020d}.{suffix}"


def chunks_prefix(prefix: str, tenant: str) -> str:
    """Where a tenant's content-addressed pieces live: ``{tenant}/.chunks/`` (never a session id,
    which cannot start with ``.``)."""
    return f"{tenant_prefix(prefix, tenant)}.chunks/"


def piece_key(prefix: str, tenant: str, ns: str, name: str, kind: str) -> str:
    """A content-addressed piece of a tenant: ``{tenant}/.chunks/{ns[:32]}/{name}.{kind}``."""
    if kind not in PIECE_KINDS:
        raise InvalidId("piece kind", f"{kind!r} is not one of {sorted(PIECE_KINDS)}")
    if not _NAME.fullmatch(ns) or not _NAME.fullmatch(name):
        raise InvalidId("piece name", "must be lowercase hex digests")
    return f"{chunks_prefix(prefix, tenant)}{ns[:32]}/{name}.{kind}"


_MANIFEST_TAIL = re.compile(r"(?P<tenant>[^/]+)/(?P<session>[^/]+)/(?P<generation>[0-9]{20})\.manifest")


def parse_manifest_key(prefix: str, key: str) -> SlotRef | None:
    """The ref a manifest key names, or None."""
    return _parse(prefix, key, _MANIFEST_TAIL)


def parse_blob_key(prefix: str, key: str) -> SlotRef | None:
    """The ref a key names, or None when the key is not a slot key under ``prefix``."""
    return _parse(prefix, key, _KEY_TAIL)


def _parse(prefix: str, key: str, tail: re.Pattern[str]) -> SlotRef | None:
    head = f"{prefix}/" if prefix else ""
    match = tail.fullmatch(key[len(head) :]) if key.startswith(head) else None
    if match is None:
        return None
    try:
        return SlotRef(match["tenant"], match["session"], int(match["generation"]))
    except InvalidId:
        return None

"""The async blob-store interface that the local-directory and S3 stores implement.

Objects are slot files addressed by :class:`~storage.ids.SlotRef` (tenant, session, generation),
never by a raw key, so no call can reach outside one tenant's namespace except
:meth:`BlobStore.list_tenants`, the operator listing that ``reindex`` needs. Every object carries
metadata (tenant, session, generation, model fingerprint, token count, size, ``crc32:%08x`` of the
whole object, and the id of the write that produced it) so that the store is the source of truth.

Writes are conditional: a generation is written once; a second writer gets :class:`WriteConflict`.
Reads land in a temporary file beside the destination, are verified against the recorded CRC and
only then renamed into place, so a destination path never holds unverified bytes.

:func:`delete_generations` removes all of a session's generations, or those below a given one
(superseded saves), so that what a tenant is charged for (``SessionIndex.stored_bytes``) is what
the store holds. :meth:`BlobStore.probe` (via :func:`storage.probe.probe_store`) checks a store's
configuration at start-up.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import mmap
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from storage.checksum import format_checksum
from storage.errors import NotStored
from storage.ids import (
    SlotRef,
    blob_key,
    document_key,
    tenant_prefix,
    validate_generation,
    validate_id,
    validate_prefix,
)


@dataclass(frozen=True)
class BlobInfo:
    """One object as a listing shows it (no user metadata)."""

    ref: SlotRef
    key: str
    size: int
    last_modified: float


@dataclass(frozen=True)
class ObjectInfo:
    """One raw object (a chunk, checkpoint, tail or manifest) as a listing shows it."""

    key: str
    size: int
    last_modified: float


@dataclass(frozen=True)
class BlobMeta:
    """One object with its metadata (from a head or a completed transfer)."""

    ref: SlotRef
    key: str
    size: int
    crc32: int | None  # None only for foreign objects written without our metadata
    model: str
    n_tokens: int
    last_modified: float
    etag: str = ""
    writer: str = ""
    # the session's routing digests, stored (storage.index.prefix_digests: they survive a reindex)
    route: str = ""
    written: int = 0  # bytes this put added to the store (a chunked save writes only what is new)

    @property
    def checksum(self) -> str | None:
        return None if self.crc32 is None else format_checksum(self.crc32)


@dataclass(frozen=True)
class PutOptions:
    """What a caller of :meth:`BlobStore.put_file` says about the file (see there)."""

    model: str
    n_tokens: int
    crc32: int | None = None
    route: str = ""
    share: bool = True


def temp_beside(dest: Path, writer: str) -> Path:
    """The temporary name a download uses next to its destination (same filesystem: atomic rename)."""
    return dest.with_name(f".{dest.name}.{writer[:12]}.part")


class BlobStore(ABC):
    """Async store of slot files; implementations must be safe to share between tasks."""

    window_bytes: int = 16 << 20
    """How many bytes of pieces a chunked restore writes at once, fetching the next few such windows
    meanwhile (:class:`storage.chunks.chunkstore.ChunkedStore`): what it holds of them."""

    def __init__(self, prefix: str) -> None:
        self.prefix = validate_prefix(prefix)

    def key_for(self, ref: SlotRef) -> str:
        return blob_key(self.prefix, ref)

    async def put_file(
        self,
        ref: SlotRef,
        path: str | Path,
        *,
        model: str,
        n_tokens: int,
        crc32: int | None = None,
        route: str = "",
        share: bool = True,
    ) -> BlobMeta:
        """Upload ``path`` as generation ``ref``; :class:`WriteConflict` if that generation exists.

        ``crc32`` is the CRC the caller expects of the whole file (e.g. from a slot file's trailer,
        :func:`storage.slotfile.reader.whole_file_crc32`); the bytes actually sent must match it, else
        :class:`ChecksumError`. Without it the store computes it first. The source file is never
        modified or removed. ``share`` lets a chunked store share this file's pieces with the tenant's
        other sessions (:class:`storage.chunks.chunkstore.ChunkedStore`); a whole-file store ignores it.
        Transient failures are retried; when they persist
        :class:`StoreUnavailable` is raised and nothing is left half-visible.
        """
        return await self._put_file(ref, Path(path), PutOptions(model, n_tokens, crc32, route, share))

    @abstractmethod
    async def _put_file(self, ref: SlotRef, path: Path, opts: PutOptions) -> BlobMeta:
        """:meth:`put_file`, as this store carries it out."""

    @abstractmethod
    async def get_to_file(self, ref: SlotRef, dest: str | Path, *, verify: bool = True) -> BlobMeta:
        """Download to ``dest`` (replaced atomically) after verifying the recorded CRC-32.

        :class:`NotStored` if absent, :class:`ChecksumError` if the bytes do not match (``dest``
        is then left as it was). ``verify=False`` is for a caller that checks the whole file's CRC
        itself as it reads it (the engine loading a slot file): a store may then skip its own pass
        over the bytes (:class:`storage.chunks.chunkstore.ChunkedStore` does; whole-file stores check as
        they copy, at no extra pass).
        """

    async def get_prefix_to_file(
        self, ref: SlotRef, dest: str | Path, tokens: Sequence[int]
    ) -> BlobMeta | None:
        """The generation cut back to the checkpoint a prompt of ``tokens`` continues from, written
        to ``dest``; None when the whole generation is what to restore. A store of whole files
        cannot cut (None); :class:`storage.chunks.chunkstore.ChunkedStore` can."""
        return None

    async def shares_prefix(self, ref: SlotRef, tokens: Sequence[int]) -> bool:
        """Whether a prompt of ``tokens`` shares a stretch worth restoring with the generation
        (another session's state a new one may start from). A store of whole files cannot tell
        without reading it: True (the engine keeps what the prompt shares)."""
        return True

    @abstractmethod
    async def head(self, ref: SlotRef) -> BlobMeta:
        """Metadata of one object; :class:`NotStored` if absent."""

    def one_read(self) -> contextlib.AbstractContextManager[None]:
        """A block (one fill: its size, its cut, its restore) in which what describes a generation
        is read from the store once, not once per call: a chunked store's manifest
        (:class:`storage.chunks.chunkstore.ChunkedStore`). A generation never changes once stored,
        and the block is one task's, so nothing it reads goes stale in it. Whole-file stores have
        nothing such to keep."""
        return contextlib.nullcontext()

    @abstractmethod
    def list(self, tenant: str, session: str | None = None) -> AsyncIterator[BlobInfo]:
        """Objects of one tenant (optionally one session), in key order."""

    @abstractmethod
    def list_tenants(self) -> AsyncIterator[str]:
        """Tenants that have objects under this store's prefix (operator use: reindex)."""

    @abstractmethod
    async def delete(self, ref: SlotRef) -> None:
        """Remove one object; deleting an absent object is not an error."""

    @abstractmethod
    async def probe(self) -> None:
        """Write, read back (checksum verified) and delete a small object outside every tenant's
        namespace (``{prefix}/.probe/``); :class:`StoreMisconfigured` when the store refuses,
        :class:`StoreUnavailable` when it cannot be reached."""

    # Documents are raw objects at keys of their own (storage.ids.document_key).
    async def put_document(self, tenant: str, kind: str, name: str, data: bytes) -> None:
        """Write (or replace) one small document of a tenant atomically: a reader sees the old bytes
        or the new ones, never a part. Documents are not slot files: listings never include them."""
        await self.put_object(document_key(self.prefix, tenant, kind, name), data)

    async def get_document(self, tenant: str, kind: str, name: str) -> bytes:
        """One document's bytes; :class:`NotStored` if absent."""
        try:
            return await self.get_object(document_key(self.prefix, tenant, kind, name))
        except NotStored:
            raise NotStored(f"{kind} document {name} not found") from None

    async def delete_document(self, tenant: str, kind: str, name: str) -> None:
        """Remove one document; an absent one is not an error."""
        await self.delete_object(document_key(self.prefix, tenant, kind, name))

    # Raw objects: keys come only from storage.ids (piece_key, manifest_key), never from a tenant.
    @abstractmethod
    async def put_object(self, key: str, data: bytes) -> None:
        """Write (or replace) one object atomically and durably."""

    @abstractmethod
    async def get_object(self, key: str) -> bytes:
        """One object's bytes; :class:`NotStored` if absent."""

    @abstractmethod
    async def put_object_file(self, key: str, path: Path) -> None:
        """Write (or replace) one object from a file, streamed: never the whole file in memory."""

    @abstractmethod
    async def get_object_file(self, key: str, dest: Path) -> int:
        """One object written to the new file ``dest``, streamed; its bytes. :class:`NotStored` if
        absent."""

    async def view_object(self, key: str) -> bytes | mmap.mmap:
        """One object's bytes as cheaply as the store can hand them over, for a reader that only
        slices them (the pieces a restore assembles): by default :meth:`get_object`'s."""
        return await self.get_object(key)

    async def view_objects(
        self, keys: Sequence[str], gate: asyncio.Semaphore
    ) -> builtins.list[bytes | mmap.mmap]:
        """:meth:`view_object` of each key, in order: by default in parallel, at most as many at
        once as ``gate`` lets through. :class:`NotStored` if one is absent."""

        async def one(key: str) -> bytes | mmap.mmap:
            async with gate:
                return await self.view_object(key)

        return builtins.list(await asyncio.gather(*(one(k) for k in keys)))

    @abstractmethod
    async def object_size(self, key: str) -> int | None:
        """The object's size in bytes, None when it is not there (one head)."""

    async def object_exists(self, key: str) -> bool:
        return await self.object_size(key) is not None

    @abstractmethod
    def list_objects(self, key_prefix: str) -> AsyncIterator[ObjectInfo]:
        """Every object whose key starts with ``key_prefix`` (a folder ending in ``/``)."""

    @abstractmethod
    async def delete_object(self, key: str) -> None:
        """Remove one object; an absent one is not an error."""

    async def stored_bytes(self, tenant: str) -> int:
        """Bytes the store holds for one tenant (every object under its folder)."""
        return sum([o.size async for o in self.list_objects(tenant_prefix(self.prefix, tenant))])

    async def latest(self, tenant: str, session: str) -> BlobInfo | None:
        """The newest generation of one session, or None."""
        newest: BlobInfo | None = None
        async for info in self.list(tenant, session):
            if newest is None or info.ref.generation > newest.ref.generation:
                newest = info
        return newest

    async def latest_per_session(self, tenant: str) -> dict[str, BlobInfo]:
        """The newest generation of every session of one tenant."""
        validate_id(tenant, "tenant id")
        newest: dict[str, BlobInfo] = {}
        async for info in self.list(tenant):
            seen = newest.get(info.ref.session)
            if seen is None or info.ref.generation > seen.ref.generation:
                newest[info.ref.session] = info
        return newest

    async def generations(self, tenant: str, session: str) -> builtins.list[int]:
        """The generations of one session the store holds, ascending."""
        return sorted([info.ref.generation async for info in self.list(tenant, session)])

    async def aclose(self) -> None:  # noqa: B027 - optional hook, most stores own nothing
        """Release threads and connections owned by the store (not the client passed in)."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


async def delete_generations(
    store: BlobStore, tenant: str, session: str, *, below: int | None = None
) -> list[SlotRef]:
    """Delete the session's stored generations — all of them, or only those ``< below`` — and
    return the refs deleted, ascending.

    Independent of the index: it works from the store's own listing, so it also removes copies
    the index never recorded (a save whose answer was lost). After a newer generation ``G`` is
    durable, ``below=G - 1`` keeps ``G`` and the one before it (a fork may still be filling from
    it). ``below`` of 0 or 1 deletes nothing. Objects vanishing meanwhile are not an error.
    """
    validate_id(tenant, "tenant id")
    validate_id(session, "session id")
    if below is not None:
        validate_generation(max(below, 0))
    refs = sorted(
        [i.ref async for i in store.list(tenant, session) if below is None or i.ref.generation < below]
    )
    for ref in refs:  # a session holds a handful of generations: one at a time is enough
        await store.delete(ref)
    return refs

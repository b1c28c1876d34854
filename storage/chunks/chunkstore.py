"""Session state in content-addressed chunks, behind the blob-store interface.

:class:`ChunkedStore` wraps a :class:`~storage.blobs.blobstore.BlobStore` (local or S3) and keeps its
contract — ``put_file`` a v1 slot file as a generation, ``get_to_file`` it back verified, ``head``,
``list``, ``delete`` — while storing each generation as pieces (:mod:`storage.chunks.chunking`):

* ``{tenant}/.chunks/{ns}/{digest}-{crc}.kv`` — attention KV of 256-token ranges;
* ``{tenant}/.chunks/{ns}/{digest}-{crc}.ck`` — checkpoints (recurrent / sliding-window state, logits),
  compressed when the store is built with ``compress`` (:mod:`storage.chunks.codec`; tails too);
* ``{tenant}/{session}/{generation}.tail`` — what is this generation's own;
* ``{tenant}/{session}/{generation}.manifest`` — the plan naming them, written last: a manifest is
  visible only once every piece it names is durable, so a save interrupted anywhere leaves the
  previous generation restorable and, at worst, pieces nothing names (collected later).

A save uploads only the pieces the store lacks (one existence check each, skipped for pieces this
process saw in the current collection epoch), so a turn writes its new tokens' KV, its new
checkpoints and its tail. A restore fetches the pieces in parallel, assembles the v1 file beside
the destination and checks the whole file's CRC (the original's, from the manifest) before the
rename; when that fails, the piece whose bytes do not match the CRC in its name is named. A node
restoring into an engine skips that pass (``verify=False``): the engine checks every byte against
the trailer's CRC as it loads the file, and the node fetches again, checked, when it refuses. Pieces
are shared by every session of one tenant whose tokens and bytes agree (forks, a common system
prompt); ``share=False`` on a save keeps them to its session. Tenants never share.

Retention: :meth:`ChunkedStore.delete` removes a generation's manifest and tail;
:meth:`ChunkedStore.collect` removes every piece no manifest names, holding the tenant against saves
through the :class:`~storage.chunks.ledger.ChunkLedger` (a piece written but not yet named is never taken),
and sets the tenant's stored bytes to what remains. v1 slot files stored before chunking (and by
stores without a ledger) are still listed, restored and deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
import zlib
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import structlog

from storage.background import in_background
from storage.blobs.blobstore import BlobInfo, BlobMeta, BlobStore, ObjectInfo, PutOptions, temp_beside
from storage.blobs.metadata import new_writer_id
from storage.chunks.chunking import (
    CHUNK_TOKENS,
    Piece,
    Split,
    describe,
    objects_needed,
    split,
    with_body_crc,
    write_v1,
)
from storage.chunks.codec import MAGIC as CODEC_MAGIC
from storage.chunks.codec import decode, encode
from storage.chunks.ledger import ChunkLedger
from storage.chunks.prefixcut import cut, cut_point, hybrid, pieces_up_to, repeats_first_chunk
from storage.errors import ChecksumError, NotStored, SlotFileError, StorageError, WriteConflict
from storage.ids import (
    SlotRef,
    chunks_prefix,
    document_key,
    manifest_key,
    parse_manifest_key,
    piece_key,
    tenant_prefix,
)
from storage.slotfile.reader import read_slot_file

log = structlog.get_logger("slotkeeper.storage")
MANIFEST_FORMAT = "slotkeeper-manifest/1"
_KNOWN_MAX = 200_000  # names remembered per tenant before the cache starts over
_HOLD_EVERY = 64  # deletes between renewals of the collector's claim


@dataclass
class CollectReport:
    tenant: str
    manifests: int = 0
    pieces: int = 0
    deleted: int = 0
    deleted_bytes: int = 0
    stored_bytes: int = 0
    ms: float = 0.0


@dataclass
class _Known:
    epoch: int
    names: dict[str, int] = field(default_factory=dict)  # key -> bytes the store holds


class ChunkedStore(BlobStore):
    """See the module doc. ``ledger`` is required for saves and collection (pieces are shared);
    ``compress``: saves store checkpoints and tails compressed (restores read either)."""

    def __init__(
        self,
        inner: BlobStore,
        ledger: ChunkLedger,
        *,
        chunk_tokens: int = CHUNK_TOKENS,
        concurrency: int = 8,
        compress: bool = False,
    ) -> None:
        super().__init__(inner.prefix)
        self.inner, self.ledger, self.chunk_tokens, self.compress = inner, ledger, chunk_tokens, compress
        self._gate = asyncio.Semaphore(concurrency)
        self._known: dict[str, _Known] = {}

    async def aclose(self) -> None:
        await self.inner.aclose()

    def key_for(self, ref: SlotRef) -> str:
        """A generation's key is its manifest's."""
        return manifest_key(self.prefix, ref)

    def _manifest(self, ref: SlotRef) -> str:
        return manifest_key(self.prefix, ref)

    def _tail(self, ref: SlotRef) -> str:
        return manifest_key(self.prefix, ref, "tail")

    def _piece(self, tenant: str, ns: str, kind: str, name: str) -> str:
        return piece_key(self.prefix, tenant, ns, name, kind)

    # -- save -------------------------------------------------------------------------------------
    async def _put_file(self, ref: SlotRef, path: Path, opts: PutOptions) -> BlobMeta:
        t0 = time.monotonic()
        s = await in_background(self._split, path, ref, opts.share)  # a save: below the engine
        if opts.crc32 is not None and s.crc32 != opts.crc32:
            raise ChecksumError(f"{path}: crc32 {s.crc32:08x}, expected {opts.crc32:08x}")
        key = self._manifest(ref)
        token = await self.ledger.claim_write(ref.tenant, key)
        if token is None:
            raise WriteConflict(f"generation {ref.generation} of session {ref.session} is being stored")
        try:
            return await self._put(ref, s, key, opts.model, opts.route, t0)
        finally:
            await self.ledger.release_write(ref.tenant, key, token)

    async def _put(self, ref: SlotRef, s: Split, key: str, model: str, route: str, t0: float) -> BlobMeta:
        if await self.inner.object_exists(key) or await self.inner.object_exists(self.inner.key_for(ref)):
            raise WriteConflict(f"generation {ref.generation} of session {ref.session} is already stored")
        written = 0
        async with self.ledger.saving(ref.tenant) as lease:
            known = self._known_names(ref.tenant, lease.epoch)
            pieces = [("kv", p) for p in s.chunks] + [("ck", p) for _, p in s.checkpoints]
            uploads = (self._ensure(ref.tenant, s.ns, kind, p, known) for kind, p in pieces)
            uploaded = await asyncio.gather(*uploads)
            written += sum(w for w, _ in uploaded)
            tail = await in_background(encode, s.tail.data) if self.compress else s.tail.data
            await self.inner.put_object(self._tail(ref), tail)
            stored = {
                p.name: size
                for (_, p), (_, size) in zip(pieces, uploaded, strict=True)
                if size != len(p.data)
            }
            doc = self._manifest_doc(ref, s, model, route, stored)
            manifest = json.dumps(doc, separators=(",", ":")).encode()
            written += len(tail) + len(manifest)
            named = self._named(doc)
            await lease.check()
            # Counted before it is visible, and never taken back if the write fails: the write may
            # have landed all the same (a lost answer). Counts too high leak until a full
            # collection; counts too low would lose pieces a manifest names.
            await self.ledger.name(ref.tenant, key, named)
            await self.inner.put_object(key, manifest)
        await self.ledger.add_bytes(ref.tenant, written)
        ms = round((time.monotonic() - t0) * 1000, 2)
        log.debug(
            "storage.chunked_put",
            key=key,
            bytes=s.size,
            written=written,
            chunks=len(s.chunks),
            checkpoints=len(s.checkpoints),
            ms=ms,
        )
        return BlobMeta(
            ref, key, s.size, s.crc32, model, s.n_tokens, time.time(), writer="", route=route, written=written
        )

    def _split(self, path: Path, ref: SlotRef, share: bool) -> Split:
        data = path.read_bytes()
        sf = read_slot_file(path, checksum=False)
        scope = ref.tenant if share else f"{ref.tenant}/{ref.session}"
        return split(data, sf, scope=scope, chunk_tokens=self.chunk_tokens)

    def _known_names(self, tenant: str, epoch: int) -> dict[str, int]:
        known = self._known.get(tenant)
        if known is None or known.epoch != epoch or len(known.names) > _KNOWN_MAX:
            known = self._known[tenant] = _Known(epoch)
        return known.names

    async def _ensure(
        self, tenant: str, ns: str, kind: str, piece: Piece, known: dict[str, int]
    ) -> tuple[int, int]:
        """Upload one piece unless the store has it: (bytes written, bytes the store holds for it).
        Checkpoints of a compressing store are stored encoded (:mod:`storage.chunks.codec`)."""
        key = self._piece(tenant, ns, kind, piece.name)
        if key in known:
            return 0, known[key]
        async with self._gate:
            size = await self.inner.object_size(key)
            if size is not None:
                known[key] = size
                return 0, size
            data = piece.data
            if self.compress and kind == "ck":
                data = await in_background(encode, data)
            await self.inner.put_object(key, data)
        known[key] = len(data)
        return len(data), len(data)

    def _named(self, doc: Mapping[str, Any]) -> dict[str, int]:
        """The pieces a manifest names, as the ledger counts them: key below the chunks folder ->
        bytes the store holds for it (a checkpoint's encoded size where the manifest says it)."""
        ns, cut = str(doc["ns"]), len(chunks_prefix(self.prefix, str(doc["tenant"])))
        stored = doc.get("stored", {})
        return {
            self._piece(str(doc["tenant"]), ns, kind, name)[cut:]: int(stored.get(name, size))
            for kind, name, size in objects_needed(doc["plan"])
            if kind != "tl"
        }

    def _manifest_doc(
        self, ref: SlotRef, s: Split, model: str, route: str, stored: Mapping[str, int]
    ) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "tenant": ref.tenant,
            "session": ref.session,
            "generation": ref.generation,
            "created": time.time(),
            "model": model,
            "route": route,
            "ns": s.ns,
            "plan": describe(s),
            "stored": dict(stored),
        }

    # -- restore ----------------------------------------------------------------------------------
    async def _read_manifest(self, ref: SlotRef) -> dict[str, Any]:
        raw = await self.inner.get_object(self._manifest(ref))
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict):
                raise ValueError("not a slotkeeper manifest")
            if doc.get("format") != MANIFEST_FORMAT:  # a later release's, or no manifest at all
                raise ValueError(
                    f"manifest format {doc.get('format')!r}, this release reads {MANIFEST_FORMAT!r}"
                )
            if [doc["tenant"], doc["session"], doc["generation"]] != [
                ref.tenant,
                ref.session,
                ref.generation,
            ]:
                raise ValueError("manifest names another generation")
            list(objects_needed(doc["plan"]))
            stored = doc.setdefault("stored", {})  # (manifests written before compression: none)
            if not isinstance(stored, dict) or not all(type(v) is int and v >= 0 for v in stored.values()):
                raise ValueError("its stored sizes are not sizes")
        except (ValueError, KeyError, TypeError, StorageError) as exc:
            raise SlotFileError("bad_layout", f"{self._manifest(ref)}: {exc}") from exc
        return doc

    async def get_to_file(self, ref: SlotRef, dest: str | Path, *, verify: bool = True) -> BlobMeta:
        try:
            doc = await self._read_manifest(ref)
        except NotStored:  # a v1 slot file stored before chunking
            return await self.inner.get_to_file(ref, dest, verify=verify)
        t0, dest = time.monotonic(), Path(dest)
        objects = await self._fetch(ref, doc)
        plan = doc["plan"]
        tmp = temp_beside(dest, new_writer_id())
        try:
            try:
                size, crc = await asyncio.to_thread(_write_file, tmp, plan, objects, verify)
                checked = verify or "body_crc32" not in plan  # (an old plan's trailer needs the CRC)
                expected = (int(plan["size"]), int(plan["crc32"]) if checked else 0)
                if (size, crc) != expected:
                    raise ChecksumError(
                        f"{self._manifest(ref)}: assembled {size} bytes crc32 {crc:08x}, "
                        f"expected {expected[0]} crc32 {expected[1]:08x}"
                    )
            except (SlotFileError, ChecksumError):
                await asyncio.to_thread(self._blame, ref, doc, objects)  # names the damaged piece
                raise
            await asyncio.to_thread(os.replace, tmp, dest)
        finally:
            await asyncio.to_thread(tmp.unlink, missing_ok=True)
        log.info(
            "storage.chunked_get",
            key=self._manifest(ref),
            bytes=size,
            pieces=len(objects),
            ms=round((time.monotonic() - t0) * 1000, 2),
        )
        return self._meta(ref, doc)

    async def shares_prefix(self, ref: SlotRef, tokens: Sequence[int]) -> bool:
        """Whether the prompt repeats the generation's first KV chunk (its manifest only)."""
        try:
            doc = await self._read_manifest(ref)
        except NotStored:
            return False
        return repeats_first_chunk(doc["plan"], str(doc["ns"]), tokens)

    async def get_prefix_to_file(
        self, ref: SlotRef, dest: str | Path, tokens: Sequence[int]
    ) -> BlobMeta | None:
        """For a prompt of ``tokens`` that leaves the generation before its end: the v1 file of its
        first P tokens (P: the checkpoint the engine would continue from), assembled from the pieces
        up to P and the tail only (:mod:`storage.chunks.prefixcut`), each checked against the CRC in its
        name. None when the whole generation is what to restore (the prompt repeats it, no
        checkpoint fits, not a hybrid model's chunks, a v1 file stored whole)."""
        try:
            doc = await self._read_manifest(ref)
        except NotStored:
            return None
        plan = doc["plan"]
        at = cut_point(plan, str(doc["ns"]), tokens)
        if at is None:
            return None
        t0, dest = time.monotonic(), Path(dest)
        chunk_ids, ckpt_ids = pieces_up_to(plan, at)
        wanted = [("kv", str(plan["chunks"][i][0]), int(plan["chunks"][i][1])) for i in chunk_ids]
        wanted += [("ck", str(plan["checkpoints"][j][1]), int(plan["checkpoints"][j][2])) for j in ckpt_ids]
        tail = [("tl", str(plan["tail"][0]), int(plan["tail"][1]))]
        objects = await self._fetch_named(ref, doc, tail)  # first: it says what model this is
        await asyncio.to_thread(self._blame, ref, doc, objects, tail)  # no whole-file CRC: each piece
        if not hybrid(objects[tail[0][1]]):
            return None  # the engine may continue such a model from further on than a checkpoint
        objects.update(await self._fetch_named(ref, doc, wanted))
        await asyncio.to_thread(self._blame, ref, doc, objects, wanted)
        try:
            cut_plan, cut_objects = cut(plan, objects, at)
        except SlotFileError as exc:
            log.warning("storage.prefix_cut_refused", key=self._manifest(ref), at=at, error=str(exc))
            return None
        tmp = temp_beside(dest, new_writer_id())
        try:
            size, crc = await asyncio.to_thread(_write_file, tmp, cut_plan, cut_objects)
            await asyncio.to_thread(os.replace, tmp, dest)
        finally:
            await asyncio.to_thread(tmp.unlink, missing_ok=True)
        ms = round((time.monotonic() - t0) * 1000, 2)
        log.info(
            "storage.prefix_get",
            key=self._manifest(ref),
            tokens=at,
            of=int(plan["n_tokens"]),
            bytes=size,
            whole=int(plan["size"]),
            pieces=len(objects),
            ms=ms,
        )
        meta = self._meta(ref, doc)
        return replace(meta, size=size, crc32=crc, n_tokens=at)

    async def _fetch(self, ref: SlotRef, doc: Mapping[str, Any]) -> dict[str, bytes]:
        return await self._fetch_named(ref, doc, list(objects_needed(doc["plan"])))

    async def _fetch_named(
        self, ref: SlotRef, doc: Mapping[str, Any], wanted: list[tuple[str, str, int]]
    ) -> dict[str, bytes]:
        """The named objects of a generation (kind, name, size), fetched in parallel (as the
        store hands them over: a local store maps them all at once); compressed states decoded."""
        ns = str(doc["ns"])
        needed = {(k, n): s for k, n, s in wanted}
        keys = [self._tail(ref) if k == "tl" else self._piece(ref.tenant, ns, k, n) for k, n in needed]
        views = cast(list[bytes], await self.inner.view_objects(keys, self._gate))  # (a map reads like bytes)

        async def one(kind: str, size: int, key: str, data: bytes) -> bytes:
            if kind != "kv" and data[:4] == CODEC_MAGIC:
                # a bytearray (no second copy of the piece): it reads like bytes here
                data = cast(bytes, await asyncio.to_thread(decode, data, size, key))
            if len(data) != size:
                raise ChecksumError(f"{key}: {len(data)} bytes, its manifest says {size}")
            return data

        items = [
            (k, s, key, data) for ((k, _), s), key, data in zip(needed.items(), keys, views, strict=True)
        ]
        done = await asyncio.gather(*(one(*item) for item in items))
        return {n: data for (_, n), data in zip(needed, done, strict=True)}

    def _blame(
        self,
        ref: SlotRef,
        doc: Mapping[str, Any],
        objects: Mapping[str, bytes],
        named: list[tuple[str, str, int]] | None = None,
    ) -> None:
        """:class:`ChecksumError` naming a piece whose bytes do not match the CRC in its name: after a
        failed assembly (the whole file's CRC is what a normal restore checks: one pass), or for
        each of ``named`` when there is no such CRC (a cut)."""
        items = list(named if named is not None else objects_needed(doc["plan"]))
        crcs = _pool().map(lambda item: zlib.crc32(objects[item[1]]), items)  # in parallel: they free the GIL
        for (kind, name, _), crc in zip(items, crcs, strict=True):
            if f"{crc:08x}" != name.rsplit("-", 1)[-1]:
                key = self._tail(ref) if kind == "tl" else self._piece(ref.tenant, str(doc["ns"]), kind, name)
                raise ChecksumError(f"{key}: its bytes do not match the CRC in its name")

    def _meta(self, ref: SlotRef, doc: Mapping[str, Any]) -> BlobMeta:
        plan = doc["plan"]
        return BlobMeta(
            ref,
            self._manifest(ref),
            int(plan["size"]),
            int(plan["crc32"]),
            str(doc.get("model", "")),
            int(plan["n_tokens"]),
            float(doc.get("created", 0.0)),
            route=str(doc.get("route", "")),
        )

    async def head(self, ref: SlotRef) -> BlobMeta:
        try:
            return self._meta(ref, await self._read_manifest(ref))
        except NotStored:
            return await self.inner.head(ref)

    async def list(self, tenant: str, session: str | None = None) -> AsyncIterator[BlobInfo]:
        found: dict[SlotRef, BlobInfo] = {}
        async for o in self.inner.list_objects(tenant_prefix(self.prefix, tenant, session)):
            ref = parse_manifest_key(self.prefix, o.key)
            if ref is not None and ref.tenant == tenant and session in (None, ref.session):
                found[ref] = BlobInfo(ref, o.key, o.size, o.last_modified)
        async for info in self.inner.list(tenant, session):
            found.setdefault(info.ref, info)
        for ref in sorted(found):
            yield found[ref]

    async def delete(self, ref: SlotRef) -> None:
        """Remove the generation: manifest first (the tail and pieces are then unnamed), tail, and
        the pieces' counts; pieces no other manifest names go at the next collection."""
        named: dict[str, int] = {}
        with contextlib.suppress(NotStored, SlotFileError):  # unreadable: a full collection decides
            named = self._named(await self._read_manifest(ref))
        freed = 0
        for key in (self._manifest(ref), self._tail(ref), self.inner.key_for(ref)):
            freed += await self._size(key)
        for key in (self._manifest(ref), self._tail(ref)):
            await self.inner.delete_object(key)
        await self.inner.delete(ref)  # a v1 slot file stored before chunking
        await self.ledger.add_bytes(ref.tenant, -freed)
        await self.ledger.unname(ref.tenant, self._manifest(ref), named)

    async def _size(self, key: str) -> int:
        async for o in self.inner.list_objects(key):
            if o.key == key:
                return o.size
        return 0

    # -- collection -------------------------------------------------------------------------------
    async def collect(self, tenant: str) -> CollectReport:
        """Delete every piece of ``tenant`` that no manifest names (and tails without a manifest),
        then set the tenant's stored bytes to what remains. Holds the tenant against saves."""
        t0, report = time.monotonic(), CollectReport(tenant)
        async with self.ledger.collecting(tenant) as claim:
            objects = [o async for o in self.inner.list_objects(tenant_prefix(self.prefix, tenant))]
            named: set[str] = set()
            counts: dict[str, int] = {}
            counted: list[str] = []
            manifests = [o for o in objects if parse_manifest_key(self.prefix, o.key)]
            for o in manifests:
                ref = parse_manifest_key(self.prefix, o.key)
                assert ref is not None
                try:
                    doc = await self._read_manifest(ref)
                except NotStored:
                    continue
                except SlotFileError as exc:  # unreadable: keep what it may name, say so
                    log.warning("storage.collect_bad_manifest", key=o.key, error=str(exc))
                    named.add("*")
                    continue
                named.add(self._tail(ref))
                counted.append(o.key)
                head = chunks_prefix(self.prefix, tenant)
                for piece in self._named(doc):
                    named.add(head + piece)
                    counts[piece] = counts.get(piece, 0) + 1
            report.manifests = len(manifests)
            garbage = [o for o in objects if self._collectable(o, named)]
            report.pieces = sum(1 for o in objects if o.key.startswith(chunks_prefix(self.prefix, tenant)))
            for i, o in enumerate(garbage):
                if i % _HOLD_EVERY == 0:
                    await claim.hold()  # a claim that lapsed (a stalled collector) stops the deletes
                await self.inner.delete_object(o.key)
                report.deleted += 1
                report.deleted_bytes += o.size
            report.stored_bytes = sum(o.size for o in objects) - report.deleted_bytes
            await self.ledger.set_bytes(tenant, report.stored_bytes)
            await self.ledger.reset_refs(tenant, counts, counted, exact="*" not in named)
            self._known.pop(tenant, None)
        report.ms = round((time.monotonic() - t0) * 1000, 2)
        log.info("storage.collected", **report.__dict__)
        return report

    async def collect_unnamed(self, tenant: str) -> CollectReport:
        """Delete the pieces whose count fell to 0 since the last collection (no listing: what a
        turn's superseded generation left). Holds the tenant against saves, like :meth:`collect`.
        Until a full collection has made the counts exact (a new Redis), it is that collection."""
        if not await self.ledger.trusted(tenant):
            return await self.collect(tenant)
        t0, report = time.monotonic(), CollectReport(tenant)
        async with self.ledger.collecting(tenant) as claim:
            unnamed = await self.ledger.unnamed(tenant)
            head = chunks_prefix(self.prefix, tenant)
            for i, (piece, size) in enumerate(unnamed.items()):
                if i % _HOLD_EVERY == 0:
                    await claim.hold()
                await self.inner.delete_object(head + piece)
                report.deleted += 1
                report.deleted_bytes += size
            await self.ledger.forget(tenant, list(unnamed))
            await self.ledger.add_bytes(tenant, -report.deleted_bytes)
            self._known.pop(tenant, None)
        report.ms = round((time.monotonic() - t0) * 1000, 2)
        if report.deleted:
            log.info("storage.collected_unnamed", **report.__dict__)
        return report

    def _collectable(self, o: ObjectInfo, named: set[str]) -> bool:
        if "*" in named or o.key in named:
            return False
        if o.key.startswith(chunks_prefix(self.prefix, self.tenant_of(o.key))):
            return o.key.endswith((".kv", ".ck"))
        return o.key.endswith(".tail")

    def tenant_of(self, key: str) -> str:
        head = f"{self.prefix}/" if self.prefix else ""
        return key[len(head) :].split("/", 1)[0]

    # -- everything else is the inner store's ------------------------------------------------------
    def list_tenants(self) -> AsyncIterator[str]:
        return self.inner.list_tenants()

    async def probe(self) -> None:
        await self.inner.probe()

    async def put_document(self, tenant: str, kind: str, name: str, data: bytes) -> None:
        old = await self._size(document_key(self.prefix, tenant, kind, name))
        await self.inner.put_document(tenant, kind, name, data)
        await self.ledger.add_bytes(tenant, len(data) - old)

    async def get_document(self, tenant: str, kind: str, name: str) -> bytes:
        return await self.inner.get_document(tenant, kind, name)

    async def delete_document(self, tenant: str, kind: str, name: str) -> None:
        old = await self._size(document_key(self.prefix, tenant, kind, name))
        await self.inner.delete_document(tenant, kind, name)
        await self.ledger.add_bytes(tenant, -old)

    async def put_object(self, key: str, data: bytes) -> None:
        await self.inner.put_object(key, data)

    async def get_object(self, key: str) -> bytes:
        return await self.inner.get_object(key)

    async def put_object_file(self, key: str, path: Path) -> None:
        await self.inner.put_object_file(key, path)

    async def get_object_file(self, key: str, dest: Path) -> int:
        return await self.inner.get_object_file(key, dest)

    async def object_size(self, key: str) -> int | None:
        return await self.inner.object_size(key)

    def list_objects(self, key_prefix: str) -> AsyncIterator[ObjectInfo]:
        return self.inner.list_objects(key_prefix)

    async def delete_object(self, key: str) -> None:
        await self.inner.delete_object(key)


def _write_file(
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
    segments = _Segments(columns=known and not verify)  # the CRC reads joined parts in file order
    size, _ = write_v1(segments, plan if known else {**plan, "body_crc32": 0}, objects, checksum=False)
    pool = _pool()
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
_ROWS_BYTES = 1 << 20  # a transposed V is written through a buffer of about this many bytes of rows
_writers: ThreadPoolExecutor | None = None
_writers_made = threading.Lock()
_scratch = threading.local()


def _pool() -> ThreadPoolExecutor:
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


class _Segments:
    """A ``write`` target that keeps what it is given, with offsets (no copy)."""

    def __init__(self, columns: bool) -> None:
        self.parts: list[tuple[int, memoryview | _Columns]] = []
        self.n = 0
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

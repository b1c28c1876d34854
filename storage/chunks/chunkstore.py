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
checkpoints and its tail. A restore fetches the pieces in parallel and writes the v1 file beside
the destination as they arrive, each KV piece into the places its plan gives it
(:mod:`storage.chunks.placement`, :mod:`storage.chunks.assembly`: a window of pieces held at a time,
not the state), then checks the whole file's CRC (the original's, from the manifest) before the
rename; a piece whose bytes do not match the CRC in its name is named. A node
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
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import structlog

from storage.background import in_background
from storage.blobs.blobstore import BlobInfo, BlobMeta, BlobStore, ObjectInfo, PutOptions, temp_beside
from storage.blobs.metadata import new_writer_id
from storage.chunks.assembly import PlacedFile, threads, write_file
from storage.chunks.chunking import (
    CHUNK_TOKENS,
    Piece,
    Split,
    describe,
    objects_needed,
    split,
    unpack_parts,
)
from storage.chunks.codec import MAGIC as CODEC_MAGIC
from storage.chunks.codec import decode, encode
from storage.chunks.ledger import ChunkLedger
from storage.chunks.placement import KvPlacement, kv_placement
from storage.chunks.prefixcut import cut, cut_point, hybrid, pieces_up_to, repeats_first_chunk
from storage.errors import ChecksumError, NotStored, SlotFileError, StorageError, WriteConflict
from storage.fetch_progress import fetched
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
_WINDOWS_HELD = 3  # windows of KV pieces a restore holds: the one it writes, the next ones coming
# The manifests read in a `ChunkedStore.one_read` block, by key (their bytes); None outside one.
_READ: ContextVar[dict[str, bytes] | None] = ContextVar("slotkeeper_manifests_read", default=None)


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
    @contextlib.contextmanager
    def one_read(self) -> Iterator[None]:
        """Manifests read in the block are kept for it (their bytes: each read parses its own)."""
        token = _READ.set({})
        try:
            yield
        finally:
            _READ.reset(token)

    async def _read_manifest(self, ref: SlotRef) -> dict[str, Any]:
        key, read = self._manifest(ref), _READ.get()
        raw = read.get(key) if read is not None else None
        if raw is None:
            raw = await self.inner.get_object(key)
            if read is not None:
                read[key] = raw
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
        t0, dest, plan = time.monotonic(), Path(dest), doc["plan"]
        placement = kv_placement(plan)
        tmp = temp_beside(dest, new_writer_id())
        try:
            if placement is None:
                size, crc, pieces = await self._assemble_held(ref, doc, tmp, verify)
            else:
                size, crc, pieces = await self._assemble_placed(ref, doc, placement, tmp, verify)
            checked = verify or "body_crc32" not in plan  # (an old plan's trailer needs the CRC)
            expected = (int(plan["size"]), int(plan["crc32"]) if checked else 0)
            if (size, crc) != expected:
                raise ChecksumError(
                    f"{self._manifest(ref)}: assembled {size} bytes crc32 {crc:08x}, "
                    f"expected {expected[0]} crc32 {expected[1]:08x}"
                )
            await asyncio.to_thread(os.replace, tmp, dest)
        finally:
            await asyncio.to_thread(tmp.unlink, missing_ok=True)
        log.info(
            "storage.chunked_get",
            key=self._manifest(ref),
            bytes=size,
            pieces=pieces,
            ms=round((time.monotonic() - t0) * 1000, 2),
        )
        return self._meta(ref, doc)

    async def _assemble_held(
        self, ref: SlotRef, doc: Mapping[str, Any], tmp: Path, verify: bool
    ) -> tuple[int, int, int]:
        """A generation without KV chunks (its state is in the tail and checkpoints): every piece
        fetched, then written; (size, crc32 or 0, pieces)."""
        objects = await self._fetch(ref, doc)
        try:
            size, crc = await asyncio.to_thread(write_file, tmp, doc["plan"], objects, verify)
        except (SlotFileError, ChecksumError):
            await asyncio.to_thread(self._blame, ref, doc, objects)  # names the damaged piece
            raise
        return size, crc, len(objects)

    async def _assemble_placed(
        self, ref: SlotRef, doc: Mapping[str, Any], placement: KvPlacement, tmp: Path, verify: bool
    ) -> tuple[int, int, int]:
        """A generation with KV chunks, written as its pieces arrive: the tail and the checkpoints
        first (the part after the KV cache is written from them meanwhile), then the chunks a
        window of bytes at a time (the next windows fetched while this one is written; the tail's
        cells with the last). What the restore holds is the checkpoints and a few windows — not
        the state. With ``verify`` each piece is checked against the CRC in its name before it is
        written, the file's CRC at the end."""
        plan = doc["plan"]
        tail = [("tl", str(plan["tail"][0]), int(plan["tail"][1]))]
        ckpts = [("ck", str(e[1]), int(e[2])) for e in plan["checkpoints"]]
        out = await asyncio.to_thread(PlacedFile, tmp, placement)
        side = [asyncio.ensure_future(asyncio.to_thread(out.prepare))]  # while the pieces come
        try:
            held = await self._fetch_named(ref, doc, tail + ckpts)
            await asyncio.to_thread(self._blame, ref, doc, held, tail + ckpts if verify else tail)
            cells = bytes(unpack_parts(held[tail[0][1]], "tail")[0])
            side.append(rest := asyncio.ensure_future(asyncio.to_thread(out.write_rest, plan, held)))
            await self._place_chunks(ref, doc, out, (cells, self._tail(ref), zlib.crc32(cells)), verify)
            try:
                await rest
            except SlotFileError:
                await asyncio.to_thread(self._blame, ref, doc, held, ckpts)
                raise
            await side[0]
            crc = await asyncio.to_thread(out.checksum, plan, verify)
        finally:
            for task in side:  # (a thread at work goes on: the file closes after it)
                task.cancel()
                task.add_done_callback(lambda f: f.cancelled() or f.exception())
            out.close()
        return placement.size, crc, len(plan["chunks"]) + len(held)

    async def _place_chunks(
        self,
        ref: SlotRef,
        doc: Mapping[str, Any],
        out: PlacedFile,
        cells: tuple[bytes, str, int],
        verify: bool,
    ) -> None:
        """The KV chunks written into ``out`` window by window, ``cells`` (the tail's) with the last;
        the windows after the one being written are fetched meanwhile."""
        ns = str(doc["ns"])
        chunks = [("kv", str(name), int(size)) for name, size in doc["plan"]["chunks"]]
        windows = list(_windows([size for _, _, size in chunks], self.inner.window_bytes)) or [range(0)]

        async def fetch(window: range) -> dict[str, bytes]:
            return await self._fetch_named(ref, doc, [chunks[i] for i in window])

        queued, ahead = iter(windows), deque[asyncio.Task[dict[str, bytes]]]()
        try:
            for window in windows:
                while len(ahead) < _WINDOWS_HELD and (w := next(queued, None)) is not None:
                    ahead.append(asyncio.create_task(fetch(w)))
                got = await ahead[0]
                ahead.popleft()
                pieces = []
                for i in window:
                    name = chunks[i][1]
                    key = self._piece(ref.tenant, ns, "kv", name)
                    pieces.append((got[name], key, int(name.rsplit("-", 1)[-1], 16)))
                if window is windows[-1]:
                    pieces.append(cells)  # the tail's range follows the last chunk's
                await asyncio.to_thread(out.place_window, window.start, pieces, verify)
                del got, pieces
        finally:
            for task in ahead:
                task.cancel()
            await asyncio.gather(*ahead, return_exceptions=True)

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
            size, crc = await asyncio.to_thread(write_file, tmp, cut_plan, cut_objects)
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
            fetched(size)  # (a watched fill's progress: storage.fetch_progress)
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
        # in parallel: they free the GIL
        crcs = threads().map(lambda item: zlib.crc32(objects[item[1]]), items)
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


def _windows(sizes: Sequence[int], budget: int) -> Iterator[range]:
    """Consecutive runs of pieces of at most ``budget`` bytes (a larger piece alone)."""
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > budget:
            yield range(start, i)
            start, total = i, 0
        total += size
    if start < len(sizes):
        yield range(start, len(sizes))

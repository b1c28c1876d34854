"""The per-node spill cache: slot files on local disk, kept by recency under a byte budget.

Tiers: slot in an engine → file here → blob store. A file enters the cache unconfirmed; it becomes
evictable only once :meth:`SpillCache.mark_uploaded` (or :meth:`SpillCache.flush`) has confirmed
that the blob store holds the same bytes. Eviction never removes an unconfirmed or pinned file,
even if that leaves the cache over budget (logged as ``spill.over_budget``): a slow or down store
costs disk, never a session. Confirmation is persisted as an empty ``.uploaded`` marker beside the
file so that it survives a restart; :meth:`SpillCache.open` rebuilds the cache from the disk.

One owner: the cache's state is mutated only by its own methods on the event loop, and file work
happens in threads while an ``asyncio.Lock`` keeps those methods from interleaving.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from storage.blobs.blobstore import BlobStore
from storage.errors import NotStored, WriteConflict
from storage.ids import SlotRef, parse_blob_key
from storage.slotfile.reader import read_slot_file, whole_file_crc32

log = structlog.get_logger("slotkeeper.storage")
_MARK = ".uploaded"


@dataclass
class _Entry:
    path: Path
    size: int
    last_used: float
    uploaded: bool
    pins: int = 0
    uploading: bool = False  # its adder uploads it: the flush leaves it alone meanwhile


class SpillCache:
    """Slot files under ``root/{tenant}/{session}/{generation:020d}.slot``, at most ``max_bytes``."""

    def __init__(self, root: str | Path, *, max_bytes: int, clock: Callable[[], float] = time.time) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._clock = clock
        self._entries: dict[SlotRef, _Entry] = {}
        self._lock = asyncio.Lock()

    @classmethod
    async def open(
        cls, root: str | Path, *, max_bytes: int, clock: Callable[[], float] = time.time
    ) -> SpillCache:
        """A cache over ``root`` that knows the files already there (after a restart)."""
        cache = cls(root, max_bytes=max_bytes, clock=clock)
        cache._entries = await asyncio.to_thread(cache._scan)
        log.debug("spill.opened", root=str(cache.root), files=len(cache._entries), bytes=cache.total_bytes)
        return cache

    def _scan(self) -> dict[SlotRef, _Entry]:
        found: dict[SlotRef, _Entry] = {}
        self.root.mkdir(parents=True, exist_ok=True)
        for path in self.root.glob("*/*/*"):
            if path.name.startswith(".") and path.name.endswith(".part"):
                path.unlink(missing_ok=True)  # an interrupted download or copy
                continue
            ref = parse_blob_key("", path.relative_to(self.root).as_posix())
            if ref is not None:
                st = path.stat()
                uploaded = path.with_name(path.name + _MARK).exists()
                found[ref] = _Entry(path, st.st_size, st.st_mtime, uploaded)
        return found

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self._entries.values())

    def path_for(self, ref: SlotRef) -> Path:
        """Where the file of ``ref`` lives (an engine may save straight to this path)."""
        return self.root / ref.tenant / ref.session / f"{ref.generation:020d}.slot"

    def __contains__(self, ref: SlotRef) -> bool:
        return ref in self._entries

    def session_refs(self, tenant: str, session: str) -> list[SlotRef]:
        """Every cached generation of one session (confirmed or not, pinned or not), ascending:
        what deleting the session must :meth:`discard` on this node."""
        return sorted(r for r in self._entries if (r.tenant, r.session) == (tenant, session))

    def pending(self) -> list[SlotRef]:
        """Files whose upload is not confirmed and that nobody is uploading now, oldest first."""
        entries = sorted(self._entries.items(), key=lambda i: i[1].last_used)
        return [r for r, e in entries if not e.uploaded and not e.uploading]

    def unconfirmed(self) -> list[SlotRef]:
        """Files whose upload is not confirmed, being uploaded now or not: what only this node holds."""
        return [r for r, e in self._entries.items() if not e.uploaded]

    def pending_bytes(self) -> int:
        """Bytes of files whose upload is not confirmed (uploading now or waiting for the store)."""
        return sum(e.size for e in self._entries.values() if not e.uploaded)

    def size_of(self, ref: SlotRef) -> int | None:
        """The size of ``ref``'s file here (None when it is not here)."""
        entry = self._entries.get(ref)
        return entry.size if entry is not None else None

    def is_uploaded(self, ref: SlotRef) -> bool:
        return self._entries[ref].uploaded

    async def add(
        self,
        ref: SlotRef,
        src: str | Path | None = None,
        *,
        uploaded: bool = False,
        pin: bool = False,
        uploading: bool = False,
    ) -> Path:
        """Adopt a file: moved from ``src`` (copied across filesystems), or already at ``path_for``.

        With ``pin`` the file is pinned before the budget is enforced (see :meth:`pin`). With
        ``uploading`` the caller uploads it now: :meth:`pending` (what :meth:`flush` uploads) leaves
        it out until :meth:`mark_uploaded` or :meth:`upload_ended` says how that went, so that a flush
        never races the caller's own upload of the same generation.
        """
        dest = self.path_for(ref)
        async with self._lock:
            size = await asyncio.to_thread(_adopt, None if src is None else Path(src), dest, uploaded)
            self._entries[ref] = _Entry(
                dest, size, self._clock(), uploaded, pins=int(pin), uploading=uploading and not uploaded
            )
            log.debug(
                "spill.add", tenant=ref.tenant, session=ref.session, generation=ref.generation, bytes=size
            )
            await self._evict_locked()
        return dest

    async def get(self, ref: SlotRef) -> Path | None:
        """The cached file of ``ref`` (marked recently used), or None."""
        entry = self._entries.get(ref)
        if entry is None:
            return None
        entry.last_used = self._clock()
        return entry.path

    def pin(self, ref: SlotRef) -> Path:
        """Keep ``ref`` from eviction until :meth:`unpin` (e.g. while an engine restores from it)."""
        entry = self._entries.get(ref)
        if entry is None:
            raise NotStored(f"generation {ref.generation} of session {ref.session} is not cached")
        entry.pins += 1
        entry.last_used = self._clock()
        return entry.path

    def unpin(self, ref: SlotRef) -> None:
        entry = self._entries.get(ref)
        if entry is not None and entry.pins > 0:
            entry.pins -= 1

    def upload_ended(self, ref: SlotRef) -> None:
        """The upload :meth:`add` was told of is over, whatever its outcome: unless it was
        confirmed, the file is pending again (the flush uploads it)."""
        entry = self._entries.get(ref)
        if entry is not None:
            entry.uploading = False

    async def mark_uploaded(self, ref: SlotRef) -> None:
        """Record that the blob store holds this file's bytes; it may now be evicted."""
        async with self._lock:
            entry = self._entries.get(ref)
            if entry is None or entry.uploaded:
                return
            entry.uploading = False
            await asyncio.to_thread(_touch, entry.path.with_name(entry.path.name + _MARK))
            entry.uploaded = True
            log.debug("spill.uploaded", tenant=ref.tenant, session=ref.session, generation=ref.generation)
            await self._evict_locked()

    async def fill(self, store: BlobStore, ref: SlotRef, *, verify: bool = True) -> Path:
        """The file of ``ref``, downloaded when not already here, returned pinned; ``verify=False``
        when the caller checks the bytes as it reads them (:meth:`BlobStore.get_to_file`).

        The caller restores from the path, then calls :meth:`unpin`.
        """
        if ref in self._entries:
            return self.pin(ref)
        dest = self.path_for(ref)
        await asyncio.to_thread(dest.parent.mkdir, parents=True, exist_ok=True)
        await store.get_to_file(ref, dest, verify=verify)
        return await self.add(ref, uploaded=True, pin=True)

    async def flush(self, store: BlobStore) -> list[SlotRef]:
        """Upload every unconfirmed file, oldest first; returns those confirmed now.

        A file whose generation already exists in the store with the same CRC (an earlier upload
        whose confirmation was lost) is confirmed; a different object there raises
        :class:`WriteConflict`; one another writer is storing right now (not visible yet) stays pending
        for the next flush. :class:`StoreUnavailable` propagates, leaving the rest pending.
        """
        done: list[SlotRef] = []
        for ref in self.pending():
            entry = self._entries.get(ref)
            if entry is None:
                continue
            sf = await asyncio.to_thread(read_slot_file, entry.path, checksum=False)
            crc = await asyncio.to_thread(whole_file_crc32, entry.path)
            try:
                await store.put_file(
                    ref, entry.path, model=sf.fingerprint or "", n_tokens=sf.n_tokens, crc32=crc
                )
            except WriteConflict:
                held = await stored_as(store, ref, crc, entry.size)
                if held is None:  # claimed by a writer still at work: confirmed once it is visible
                    log.info(
                        "spill.flush_later",
                        tenant=ref.tenant,
                        session=ref.session,
                        generation=ref.generation,
                        why="being stored",
                    )
                    continue
                if not held:
                    raise
            await self.mark_uploaded(ref)
            done.append(ref)
        return done

    async def discard(self, ref: SlotRef) -> None:
        """Remove a file whatever its state (its session was deleted)."""
        async with self._lock:
            entry = self._entries.pop(ref, None)
            if entry is not None:
                await asyncio.to_thread(_remove, entry.path)
                log.info("spill.discard", tenant=ref.tenant, session=ref.session, generation=ref.generation)

    async def evict(self) -> list[SlotRef]:
        """Evict least recently used confirmed, unpinned files until within budget."""
        async with self._lock:
            return await self._evict_locked()

    async def _evict_locked(self) -> list[SlotRef]:
        evicted: list[SlotRef] = []
        total = self.total_bytes
        for ref, entry in sorted(self._entries.items(), key=lambda i: i[1].last_used):
            if total <= self.max_bytes:
                break
            if not entry.uploaded or entry.pins:
                continue
            await asyncio.to_thread(_remove, entry.path)
            del self._entries[ref]
            total -= entry.size
            evicted.append(ref)
            log.debug(
                "spill.evict",
                tenant=ref.tenant,
                session=ref.session,
                generation=ref.generation,
                bytes=entry.size,
            )
        if total > self.max_bytes and self.pending():  # pinned files are in use for a moment only
            log.warning(
                "spill.over_budget", bytes=total, max_bytes=self.max_bytes, pending=len(self.pending())
            )
        return evicted


async def stored_as(store: BlobStore, ref: SlotRef, crc: int, size: int) -> bool | None:
    """After an upload of ``ref`` met :class:`WriteConflict`: True when the store holds these bytes
    (another upload of them landed), False when it holds others, None when another writer has
    claimed the generation and its object is not visible yet."""
    try:
        remote = await store.head(ref)
    except NotStored:
        return None
    return remote.crc32 == crc and remote.size == size


def _adopt(src: Path | None, dest: Path, uploaded: bool) -> int:
    dest.parent.mkdir(parents=True, exist_ok=True)
    if src is not None and src != dest:
        try:
            os.replace(src, dest)
        except OSError:  # another filesystem: copy beside, then rename
            tmp = dest.with_name(f".{dest.name}.part")
            shutil.copyfile(src, tmp)
            os.replace(tmp, dest)
            src.unlink()
    marker = dest.with_name(dest.name + _MARK)
    if uploaded:
        _touch(marker)
    else:
        marker.unlink(missing_ok=True)
    return dest.stat().st_size


def _touch(path: Path) -> None:
    path.touch()


def _remove(path: Path) -> None:
    path.with_name(path.name + _MARK).unlink(missing_ok=True)
    path.unlink(missing_ok=True)
    for parent in (path.parent, path.parent.parent):
        try:
            parent.rmdir()
        except OSError:
            break

"""A node's fills: a stored generation restored into an engine's slot, within the restore gate.

A fill takes the generation from the spill cache, else from the store (the whole file, or only
the part up to the checkpoint the prompt continues from), hard-links it into the engine's slot
directory and asks the engine to restore it. Every restore into a slot — a fill, or a handoff's
install — holds its file's bytes through the node's :mod:`.restore_gate`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from engine_pool.errors import ApiError
from storage.blobs.blobstore import BlobStore
from storage.blobs.spillcache import SpillCache
from storage.errors import ChecksumError, SlotFileError
from storage.ids import SlotRef

from ..protocol.node import FillProgress, FillResult
from ..protocol.slot_actions import SlotAnswer, SlotRestored
from .fill_progress import FillWatch
from .handoff import link_or_copy
from .metrics import NodeMetrics
from .restore_gate import RestoreGate
from .slot_call import SlotCaller
from .supervisor import EngineSupervisor

log = structlog.get_logger("engine.node")
DAMAGED = frozenset({"truncated", "bad_magic", "checksum_mismatch", "bad_layout"})


@dataclass(frozen=True)
class Filler:
    """The node's fill path, over its store, spill cache and engines' slot actions."""

    store: BlobStore
    cache: SpillCache
    gate: RestoreGate
    metrics: NodeMetrics
    slot_call: SlotCaller

    async def fill(
        self,
        sup: EngineSupervisor,
        slot: int,
        ref: SlotRef,
        tokens: list[int] | None = None,
        prefix: bool = False,
        progress: Callable[[FillProgress], None] | None = None,
    ) -> FillResult:
        """Restore ``ref`` into the slot. A file fetched for it is not checked by the store: the
        engine checks every byte's CRC as it loads it, one pass instead of two. When the engine
        finds the bytes damaged and the store holds the generation (a copy on this disk, or one
        just assembled from the store), that copy goes, the store's copy is fetched again with the
        store's own check (naming a damaged piece, if that is where the damage is) and restored.
        With the prompt's ``tokens`` and no copy here, a prompt that leaves the generation early
        gets only the part up to the checkpoint it continues from (:mod:`storage.chunks.prefixcut`).
        ``prefix``: ``ref`` is another session's generation the prompt may start from (a shared
        prefix): restored up to its checkpoint, else whole when the prompt repeats its first chunk,
        else not at all (``source`` "none", the slot left as it was). The session's own generation
        labels the slot with it (the gateway's turn then names it: the slot fence); a prefix is
        nobody's there. ``progress`` is sent a `FillProgress` as each stage begins and as the
        fetched bytes come in (engine_pool.pool.fill_progress)."""
        t0 = time.monotonic()
        source = "local" if ref in self.cache else "store"
        label = None if prefix else {"slot_owner": ref.tenant, "slot_session": ref.session}
        with self.store.one_read():  # its manifest read once, whatever the steps below ask of it
            size = await self._size(ref, source, progress is not None)
            watch = FillWatch(progress, size)
            async with self.restoring(size, **_slot_fields(sup, slot, ref)):
                cut = bool(tokens) and source == "store"
                out = await self._cut(sup, slot, ref, tokens or [], label, watch) if cut else None
                if out is not None:
                    source = "cut"
                elif prefix and source == "store" and not await self.store.shares_prefix(ref, tokens or []):
                    source = "none"
                else:
                    out, source = await self._whole(sup, slot, ref, source, label, watch)
        await self.cache.evict()  # with a budget of 0 (one machine, local store) the copy goes now
        ms = round((time.monotonic() - t0) * 1000, 2)
        n_tokens, n_bytes = (out.n_restored, out.n_read) if out is not None else (0, 0)
        result = FillResult(n_tokens, n_bytes, source, ms)
        log.info("node.filled", **_slot_fields(sup, slot, ref), **result.to_json())
        return result

    async def installing_call(
        self,
        sup: EngineSupervisor,
        slot: int,
        answer: type[SlotAnswer],
        filename: str | None = None,
        label: Mapping[str, Any] | None = None,
    ) -> SlotAnswer:
        """A slot action for a handoff: a state restored into the slot (the handed state, or a
        carried one put back) holds its file's bytes through the gate, as a fill does."""
        if answer is not SlotRestored or filename is None:
            return await self.slot_call(sup, slot, answer, filename, label)
        size = await asyncio.to_thread(_size_of, sup.spec.slot_dir / filename) if self.gate.budget else 0
        who = {"tenant": (label or {}).get("slot_owner"), "session": (label or {}).get("slot_session")}
        async with self.restoring(size, engine=sup.spec.engine_id, slot=slot, **who):
            return await self.slot_call(sup, slot, answer, filename, label)

    @asynccontextmanager
    async def restoring(self, n: int, **fields: Any) -> AsyncIterator[None]:
        """A restore of ``n`` bytes admitted by the gate; a wait for it counted and logged with
        ``fields``."""
        async with self.gate.admit(n) as waited:
            if waited:
                self.metrics.restores_waited.inc()
                log.info("node.restore_waited", **fields, ms=round(waited * 1000, 2))
            yield

    async def _size(self, ref: SlotRef, source: str, wanted: bool = False) -> int:
        """The bytes a restore of ``ref`` holds in flight: its file's size, from the spill cache or
        from the store (a manifest read; none when restores are unbounded, unless ``wanted``)."""
        if not self.gate.budget and not wanted:
            return 0
        if source == "local":
            size = self.cache.size_of(ref)
            if size is not None:
                return size
        return (await self.store.head(ref)).size

    async def _cut(
        self,
        sup: EngineSupervisor,
        slot: int,
        ref: SlotRef,
        tokens: list[int],
        label: dict[str, str] | None,
        watch: FillWatch,
    ) -> SlotRestored | None:
        """The generation up to the prompt's checkpoint, restored; None when there is no such cut
        (or the engine refused it: the whole generation is restored then)."""
        name = f"fill-{uuid.uuid4().hex}.slot"
        dest = sup.spec.slot_dir / name
        try:
            with watch.fetching():
                if await self.store.get_prefix_to_file(ref, dest, tokens) is None:
                    return None
            watch.restoring()
            return await self.slot_call(sup, slot, SlotRestored, name, label)
        except ApiError as err:
            if err.extra.get("kind") not in DAMAGED:
                raise
            log.warning("node.cut_refused", **_slot_fields(sup, slot, ref), error=err.message)
            return None
        finally:
            await asyncio.to_thread(dest.unlink, missing_ok=True)

    async def _whole(
        self,
        sup: EngineSupervisor,
        slot: int,
        ref: SlotRef,
        source: str,
        label: dict[str, str] | None,
        watch: FillWatch,
    ) -> tuple[SlotRestored, str]:
        """The whole generation restored, and where it came from in the end (see :meth:`fill`)."""
        cache = self.cache
        try:
            return await self._restore(sup, slot, ref, label, watch, verify=False), source
        except ApiError as err:
            if err.extra.get("kind") not in DAMAGED or (ref in cache and not cache.is_uploaded(ref)):
                raise  # not damage, or the only copy there is (not uploaded yet)
            log.warning("node.fill_damaged", **_slot_fields(sup, slot, ref), source=source, error=err.message)
            if ref in cache:
                await cache.discard(ref)
        try:
            return await self._restore(sup, slot, ref, label, watch, verify=True), "store"
        except ChecksumError as exc:  # the store's own copy is damaged: no retry brings it back
            log.error("node.stored_copy_damaged", **_slot_fields(sup, slot, ref), error=str(exc))
            raise SlotFileError("checksum_mismatch", str(exc)) from exc

    async def _restore(
        self,
        sup: EngineSupervisor,
        slot: int,
        ref: SlotRef,
        label: dict[str, str] | None,
        watch: FillWatch,
        *,
        verify: bool,
    ) -> SlotRestored:
        with watch.fetching() if ref not in self.cache else contextlib.nullcontext():
            path = await self.cache.fill(self.store, ref, verify=verify)  # pinned
        name = f"fill-{uuid.uuid4().hex}.slot"
        link = sup.spec.slot_dir / name
        try:
            await asyncio.to_thread(link_or_copy, path, link)
            watch.restoring()
            return await self.slot_call(sup, slot, SlotRestored, name, label)
        finally:
            await asyncio.to_thread(link.unlink, missing_ok=True)
            self.cache.unpin(ref)


def ref_fields(ref: SlotRef) -> dict[str, Any]:
    """A generation's fields of a log event."""
    return {"tenant": ref.tenant, "session": ref.session, "generation": ref.generation}


def _slot_fields(sup: EngineSupervisor, slot: int, ref: SlotRef) -> dict[str, Any]:
    """The fields of a log event about one generation in one engine's slot."""
    return {"engine": sup.spec.engine_id, "slot": slot, **ref_fields(ref)}


def _size_of(path: Path) -> int:
    """A file's size; 0 when it is not there (the engine says so as it is asked to restore it)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0

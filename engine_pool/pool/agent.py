"""The node agent: K supervised engines, slot files moved between them, the spill cache and the store.

`NodeAgent` holds the node's parts (created by `node_main` in the app's lifespan and handed in)
and carries out the node API (its routes: `engine_pool.pool.routes`):

* spill — the engine saves the slot into its slot dir; the file moves into the spill cache
  (pinned), is uploaded with its model fingerprint and token count, and is confirmed. A store that
  is down leaves the file in the cache, unconfirmed (never evicted), for the flush loop.
* fill — from the cache, else downloaded into it; hard-linked into the engine's slot dir for the
  restore, and unlinked after (:mod:`.fill`). A file the engine refuses leaves the slot empty.
* drain (SIGTERM) — stop admitting, spill every session the index says is live on our engines as
  its next generation and mark it spilled, flush, stop the engines.

Background loops, each the only writer of what it touches: the supervisors' run loops (engine
state), the registry loop (our engines' registry entries: register a newly ready process after
dropping the sessions the index still places on that engine id, heartbeat, unregister), the flush
loop (retries unconfirmed uploads with backoff).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx
import structlog

from engine_pool.errors import (
    ApiError,
    NotFound,
    Unavailable,
    Upstream,
)
from engine_pool.process.loop import cancel_and_wait
from storage.blobs.blobstore import BlobStore
from storage.blobs.spillcache import SpillCache, stored_as
from storage.errors import (
    LockBusy,
    LockLost,
    StorageError,
    StoreUnavailable,
    WriteConflict,
)
from storage.ids import SlotRef
from storage.index.engines import EngineRegistry
from storage.index.generations import save_as_next_generation
from storage.index.session_index import SessionIndex
from storage.slotfile.reader import SlotFile, read_slot_file, whole_file_crc32

from ..protocol.handoff import HandoffOutcome, HandoffRequest, HandoffResult, Prefilled, Role
from ..protocol.node import (
    CancelResult,
    EraseResult,
    FillProgress,
    SlotResult,
    SpillResult,
    UnstoredCopy,
)
from ..protocol.slot_actions import SlotCancelled, SlotErased, SlotSaved
from .fill import Filler, ref_fields
from .handoff import PrefillSlots, choose, hand_off, one_source, outcome_of, prefill_to_file
from .handoff_peer import hand_off_remote
from .handoff_store import hand_off_stored
from .metrics import NodeMetrics
from .restore_gate import RestoreGate
from .settings import NodeSettings
from .slot_call import SlotCaller
from .supervisor import EngineSnapshot, EngineSpec, EngineSupervisor, State

log = structlog.get_logger("engine.node")


@dataclass
class NodeParts:
    """What the agent works with; created and closed by the lifespan."""

    store: BlobStore
    cache: SpillCache
    index: SessionIndex
    registry: EngineRegistry
    http: httpx.AsyncClient


class NodeAgent:
    def __init__(
        self,
        settings: NodeSettings,
        parts: NodeParts,
        specs: list[EngineSpec] | None = None,
        *,
        on_no_engines: Callable[[dict[str, str]], None] | None = None,
    ) -> None:
        self.settings, self.parts, policy = settings, parts, settings.supervisor_policy()
        self.metrics = NodeMetrics()
        self.engines = {
            spec.engine_id: EngineSupervisor(spec, policy, http=parts.http, on_transition=self._changed)
            for spec in specs or settings.engine_specs()
        }
        self.prefill_slots = PrefillSlots(
            {e: sup.spec.n_slots for e, sup in self.engines.items() if sup.spec.role == Role.PREFILL}
        )
        self._slot_call = SlotCaller(parts.http, settings.retry_after_s)
        self.restores = RestoreGate(settings.restore_bytes_in_flight)
        self.filler = Filler(parts.store, parts.cache, self.restores, self.metrics, self._slot_call)
        self.draining = False
        self._engines_changed = asyncio.Event()
        self._unregistered = asyncio.Event()  # set by the registry loop once draining took effect
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: list[asyncio.Task[None]] = []
        # Called once every engine has given up (`failed`: the same failed start, again and again),
        # with each one's reason: this node serves nothing until asked to start them again.
        self._on_no_engines = on_no_engines
        self._said_no_engines = False

    def _changed(self, snapshot: EngineSnapshot) -> None:
        self._engines_changed.set()
        if snapshot.state is State.FAILED and not self._said_no_engines and self.all_failed():
            self._said_no_engines = True
            reasons = {sup.spec.engine_id: sup.snapshot().error for sup in self.engines.values()}
            log.error("node.no_engines", node=self.settings.node_id, reasons=reasons)
            if self._on_no_engines is not None:
                self._on_no_engines(reasons)

    def all_failed(self) -> bool:
        """Every engine of this node has given up."""
        return bool(self.engines) and all(sup.state is State.FAILED for sup in self.engines.values())

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        for sup in self.engines.values():
            # Only this node writes there: whatever is left is a transfer a crash interrupted.
            await asyncio.to_thread(_clear_dir, sup.spec.slot_dir)
        for sup in self.engines.values():
            self._tasks.append(asyncio.create_task(sup.run()))
            sup.start()
        self._tasks.append(asyncio.create_task(self._registry_loop()))
        self._tasks.append(asyncio.create_task(self._flush_loop()))
        log.info("node.started", node=self.settings.node_id, engines=list(self.engines))

    async def close(self) -> None:
        """Stop everything (engines not stopped by a drain are stopped now) and unregister."""
        await self._stop_engines("node closing")
        await cancel_and_wait(*self._tasks)

    async def drain(self) -> bool:
        """SIGTERM: spill every live session, stop the engines. True when every spill is uploaded."""
        s = self.settings
        self.draining = True
        self._engines_changed.set()
        log.info("node.draining", node=s.node_id, grace_s=s.drain_grace_s)
        ok, saved = False, 0
        try:
            async with asyncio.timeout(max(s.drain_grace_s - s.engine_stop_grace_s - 1, s.drain_grace_s / 2)):
                with suppress(TimeoutError):  # no new sessions placed here (Redis may be down)
                    async with asyncio.timeout(5):
                        await self._unregistered.wait()
                await self._idle.wait()  # operations admitted before the drain
                results = await asyncio.gather(*(self._drain_engine(sup) for sup in self.engines.values()))
                with suppress(StorageError):
                    await self.parts.cache.flush(self.parts.store)
                ok = all(done for done, _ in results) and not self.parts.cache.pending()
                saved = sum(n for _, n in results)
        except TimeoutError:
            log.error("node.drain_timeout", node=s.node_id)
        await self._stop_engines("node draining")
        unflushed = len(self.parts.cache.pending())
        log.info("node.drained", node=s.node_id, ok=ok, sessions_saved=saved, unflushed=unflushed)
        return ok

    async def _stop_engines(self, reason: str) -> None:
        """SIGTERM, grace, SIGKILL; a supervisor that does not answer in time is cancelled (kills)."""
        timeout = self.settings.engine_stop_grace_s + 10
        results = await asyncio.gather(
            *(sup.stop(reason, timeout_s=timeout) for sup in self.engines.values()), return_exceptions=True
        )
        for task, result in zip(self._tasks, results, strict=False):  # the first tasks are the supervisors'
            if isinstance(result, BaseException):
                task.cancel()

    async def _drain_engine(self, sup: EngineSupervisor) -> tuple[bool, int]:
        """Spill the engine's live sessions one by one: whether every one was (False also when Redis
        is down), and how many were."""
        if sup.state is not State.READY:
            return True, 0
        # The generations still running end now: nobody would wait out a drain for them (their
        # clients get what was written), and a busy slot cannot be spilled.
        for n in range(sup.spec.n_slots):
            with suppress(ApiError):
                if (await self._slot_call(sup, n, SlotCancelled)).cancelled:
                    log.info("node.drain_cancelled", engine=sup.spec.engine_id, slot=n)
        index, ok = self.parts.index, True
        try:
            sessions = await index.engine_sessions(sup.spec.engine_id)
        except StorageError as exc:
            log.error("node.drain_index_failed", engine=sup.spec.engine_id, error=str(exc))
            return False, 0
        saved = 0
        for tenant, session in sessions:
            try:
                record = await index.find(tenant, session)
                place = record.place if record is not None else None
                if record is None or place is None:
                    continue
                ref, out = await self._spill_next(sup, place[1], tenant, session, record.stored_routes)
                await index.mark_spilled(
                    tenant,
                    session,
                    generation=ref.generation,
                    blob_key=out.key,
                    nbytes=out.bytes,
                    tokens=out.tokens,
                )
                ok = ok and out.uploaded
                saved += 1
            except (ApiError, StorageError) as exc:
                log.error("node.drain_spill_failed", tenant=tenant, session=session, error=str(exc))
                ok = False
        return ok, saved

    async def _spill_next(
        self, sup: EngineSupervisor, slot: int, tenant: str, session: str, route: str
    ) -> tuple[SlotRef, SpillResult]:
        """Spill as the session's next generation, chosen as every save chooses it
        (storage.index.generations): handed out by the index, so a gateway's write-behind save that
        reserved one a moment ago never collides with this one."""

        async def reserve() -> int:
            return await self.parts.index.reserve_generation(tenant, session)

        async def spill(generation: int) -> tuple[SlotRef, SpillResult]:
            ref = SlotRef(tenant, session, generation)
            return ref, await self._spill(sup, slot, ref, route)

        def taken(exc: Exception) -> bool:  # held already, in the spill cache or the store
            return isinstance(exc, WriteConflict)

        return await save_as_next_generation(session, reserve, spill, taken)

    # -- operations ------------------------------------------------------------------------------
    def _engine(self, engine_id: str, slot: str) -> tuple[EngineSupervisor, int]:
        """The ready engine and slot number of an API path, or 404/503."""
        if self.draining:
            raise Unavailable("the node is draining", retry_after=self.settings.retry_after_s)
        sup = self.engines.get(engine_id)
        if sup is None:
            raise NotFound(f"engine {engine_id!r} is not on this node (engines: {', '.join(self.engines)})")
        if not slot.isdigit() or int(slot) >= sup.spec.n_slots:
            raise NotFound(f"slot {slot!r} does not exist (engine {engine_id} has 0..{sup.spec.n_slots - 1})")
        if sup.state is not State.READY:
            why = f": {sup.snapshot().error}" if sup.state is State.FAILED else ""
            retry = self.settings.retry_after_s
            raise Unavailable(f"engine {engine_id} is {sup.state}{why}", retry_after=retry)
        return sup, int(slot)

    async def operation(
        self,
        op: str,
        engine_id: str,
        slot: str,
        ref: SlotRef | None,
        route: str = "",
        share: bool = True,
        tokens: list[int] | None = None,
        prefix: bool = False,
        fenced: bool = False,
        progress: Callable[[FillProgress], None] | None = None,
    ) -> SlotResult:
        sup, n = self._engine(engine_id, slot)
        t0 = time.monotonic()
        result: SlotResult | None = None
        with self._admitted():
            try:
                if op == "erase":
                    result = EraseResult((await self._slot_call(sup, n, SlotErased)).n_erased)
                elif op == "cancel":  # the generation running there ends (a busy session's DELETE)
                    result = CancelResult((await self._slot_call(sup, n, SlotCancelled)).cancelled)
                else:
                    assert ref is not None
                    spill = op == "spill"
                    result = await (
                        self._spill(sup, n, ref, route, share, fenced)
                        if spill
                        else self.filler.fill(sup, n, ref, tokens, prefix, progress)
                    )
                return result
            finally:
                self.metrics.observe(op, time.monotonic() - t0, result)

    async def handoff(self, engine_id: str, slot: str, req: HandoffRequest) -> HandoffResult:
        """A turn's prompt prefilled on a prefill engine — of this node (engine_pool.pool.handoff) or
        of the node agent at ``req.prefill_node`` (engine_pool.pool.handoff_peer), or its state
        taken from the store (``req.from_store``: engine_pool.pool.handoff_store) — and installed in
        this slot; counted by how it ended, logged either way."""
        one_source(req)
        sup, n = self._engine(engine_id, slot)
        with self._admitted():
            t0 = time.monotonic()
            try:
                if req.from_store:
                    out = await hand_off_stored(self.parts.store, self.filler.installing_call, sup, n, req)
                elif req.prefill_node:
                    out = await hand_off_remote(self.parts.http, self.filler.installing_call, sup, n, req)
                else:
                    prefill = self.prefill_engine(req.prefill_engine, sup.spec.model_id)
                    out = await hand_off(
                        self.parts.http, self.prefill_slots, self.filler.installing_call, sup, n, prefill, req
                    )
            except (Exception, asyncio.CancelledError) as exc:
                result = outcome_of(exc)
                self.metrics.handoff_failed(result, time.monotonic() - t0)
                log.warning(
                    "node.handoff_failed",
                    engine=engine_id,
                    slot=n,
                    prefill=req.prefill_engine,
                    prefill_node=req.prefill_node or None,
                    tenant=req.tenant,
                    session=req.session,
                    result=result.value,
                    error=str(exc),
                )
                raise
        self.metrics.handoff_done(out)
        log.info(
            "node.handed_off",
            engine=engine_id,
            slot=n,
            tenant=req.tenant,
            session=req.session,
            **out.to_json(),
        )
        return out

    def prefill_engine(self, engine_id: str, model: str) -> EngineSupervisor:
        """A ready prefill engine of this node serving ``model`` ('' any), or 404/400/503."""
        if self.draining:
            raise Unavailable("the node is draining", retry_after=self.settings.retry_after_s)
        roles = {e: s.spec.role for e, s in self.engines.items()}
        return choose(self.engines.get(engine_id), engine_id, model, roles)

    async def prefill(
        self, engine_id: str, req: HandoffRequest, carried: Path | None, name: str
    ) -> Prefilled:
        """Another node's handoff: ``req``'s prompt prefilled on a lent slot of this node's prefill
        engine (from the ``carried`` state, a file in its slot directory, if any) and exported as
        ``name`` there (engine_pool.pool.handoff_peer); counted by how it ended."""
        prefill = self.prefill_engine(engine_id, req.model)
        with self._admitted():
            try:
                done = await prefill_to_file(
                    self.parts.http,
                    self.prefill_slots,
                    self._slot_call,
                    prefill,
                    req,
                    carried.name if carried is not None else None,
                    name,
                )
            except (Exception, asyncio.CancelledError) as exc:
                result = outcome_of(exc)
                self.metrics.peer_prefills.labels(result.value).inc()
                log.warning(
                    "node.prefill_failed",
                    engine=engine_id,
                    tenant=req.tenant,
                    session=req.session,
                    result=result.value,
                    error=str(exc),
                )
                raise
        self.metrics.peer_prefills.labels(HandoffOutcome.DONE.value).inc()
        log.info("node.prefilled", engine=engine_id, tenant=req.tenant, session=req.session, **done.to_json())
        return done

    @contextmanager
    def _admitted(self) -> Iterator[None]:
        """An operation the drain waits for."""
        self._inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._inflight -= 1
            if not self._inflight:
                self._idle.set()

    async def forget(self, tenant: str, session: str) -> int:
        """Discard every spill-cache file of the session, confirmed or not; returns how many."""
        refs = self.parts.cache.session_refs(tenant, session)
        for ref in refs:
            await self.parts.cache.discard(ref)
        log.info("node.forgot", tenant=tenant, session=session, files=len(refs))
        return len(refs)

    async def unstored(self, tenant: str | None = None, session: str | None = None) -> list[UnstoredCopy]:
        """The generations only this node's spill cache holds (the store does not yet), of one
        session when ``tenant`` and ``session`` are given; a file gone or unreadable meanwhile is
        left out (the flush deals with it)."""
        cache, store = self.parts.cache, self.parts.store
        refs = [
            r for r in cache.unconfirmed() if session is None or (r.tenant, r.session) == (tenant, session)
        ]
        found = await asyncio.to_thread(_describe, [cache.path_for(r) for r in refs])
        return [
            UnstoredCopy(r.tenant, r.session, r.generation, store.key_for(r), *f)
            for r, f in zip(refs, found, strict=True)
            if f is not None
        ]

    async def _spill(
        self,
        sup: EngineSupervisor,
        slot: int,
        ref: SlotRef,
        route: str = "",
        share: bool = True,
        fenced: bool = False,
    ) -> SpillResult:
        """Save, cache and upload; `route` (the session's newest routing digest) travels in the
        object's metadata so that a reindex restores implicit routing too; `share` lets the stored
        chunks be shared with the tenant's other sessions; `fenced`: the engine saves only while
        the slot's label names the session (else 409 slot_changed)."""
        cache, t0 = self.parts.cache, time.monotonic()
        if ref in cache:
            raise WriteConflict(
                f"generation {ref.generation} of session {ref.session} was already spilled here"
            )
        waiting = cache.pending_bytes()
        if waiting >= self.settings.spill_pending_bytes:  # the store has been away for a while
            log.warning("node.saves_held", pending_bytes=waiting, limit=self.settings.spill_pending_bytes)
            raise Unavailable(
                f"{waiting} bytes of saves are waiting for the store; no more are taken until it is back",
                retry_after=self.settings.retry_after_s,
            )
        name = f"spill-{uuid.uuid4().hex}.slot"
        src = sup.spec.slot_dir / name
        label = {"slot_owner": ref.tenant, "slot_expect": ref.session} if fenced else {}
        await self._slot_call(sup, slot, SlotSaved, name, label)
        try:
            sf = await asyncio.to_thread(read_slot_file, src, checksum=False)
            crc = await asyncio.to_thread(whole_file_crc32, src)
        except StorageError as exc:
            await asyncio.to_thread(src.unlink, missing_ok=True)
            raise Upstream(f"engine {sup.spec.engine_id} wrote an unreadable slot file: {exc}") from exc
        written = await self._keep(ref, src, sf, crc, route, share)
        await cache.evict()
        out = SpillResult(
            ref.tenant,
            ref.session,
            ref.generation,
            self.parts.store.key_for(ref),
            sf.size,
            sf.n_tokens,
            uploaded=written is not None,
            written=written or 0,
            ms=round((time.monotonic() - t0) * 1000, 2),
        )
        log.debug("node.spilled", engine=sup.spec.engine_id, slot=slot, **out.to_json())
        return out

    async def _keep(
        self, ref: SlotRef, src: Path, sf: SlotFile, crc: int, route: str = "", share: bool = True
    ) -> int | None:
        """Adopt the saved file ``sf`` (at ``src``) into the spill cache and upload it (see
        :meth:`_upload`). The flush loop keeps off it meanwhile: two uploads of one generation would
        race for its claim, and the loser could not yet see the winner's object."""
        cache = self.parts.cache
        path = await cache.add(ref, src, pin=True, uploading=True)
        try:
            return await self._upload(ref, path, sf, crc, route, share)
        finally:
            cache.upload_ended(ref)
            cache.unpin(ref)

    async def _upload(
        self, ref: SlotRef, path: Path, sf: SlotFile, crc: int, route: str, share: bool
    ) -> int | None:
        """Upload, with the model fingerprint and token count ``sf`` names; the bytes it added to
        the store, or None when it stays pending (store down, another writer storing the same
        generation)."""
        store, cache = self.parts.store, self.parts.cache
        written = 0
        deferred: str | None = None  # why it stays pending
        try:
            model, tokens = sf.fingerprint or "", sf.n_tokens
            meta = await store.put_file(
                ref, path, model=model, n_tokens=tokens, crc32=crc, route=route, share=share
            )
            written = meta.written
        except (StoreUnavailable, LockBusy, LockLost) as exc:
            deferred = str(exc)
        except WriteConflict:
            held = await stored_as(store, ref, crc, sf.size)  # another writer stored it a moment ago?
            if held is None:  # or is storing it now: it stays pending, the flush confirms it later
                deferred = "being stored by another writer"
            elif not held:
                await cache.discard(ref)
                raise
        if deferred is not None:
            log.warning("node.upload_deferred", **ref_fields(ref), error=deferred)
            return None
        await cache.mark_uploaded(ref)
        return written

    # -- background loops ------------------------------------------------------------------------
    async def _registry_loop(self) -> None:
        """The only writer of our engines' registry entries; unregisters them when draining or closed."""
        registered: dict[str, int | None] = {}  # engine id -> the pid it was registered for
        try:
            while True:
                self._engines_changed.clear()
                for sup in self.engines.values():
                    try:
                        await self._reconcile(sup, registered)
                    except StorageError as exc:
                        log.warning("node.registry_failed", engine=sup.spec.engine_id, error=str(exc))
                if self.draining and not registered:
                    self._unregistered.set()
                with suppress(TimeoutError):
                    async with asyncio.timeout(self.settings.heartbeat_ttl_s / 3):
                        await self._engines_changed.wait()
        finally:
            for engine_id in registered:
                with suppress(StorageError):
                    await self.parts.registry.unregister(engine_id)

    async def _reconcile(self, sup: EngineSupervisor, registered: dict[str, int | None]) -> None:
        snap, registry, ttl = sup.snapshot(), self.parts.registry, self.settings.heartbeat_ttl_s
        engine_id = snap.engine_id
        if snap.state is State.READY and not self.draining:
            if registered.get(engine_id, -1) != snap.pid:
                dropped = await self.parts.index.drop_engine(engine_id)  # a new process: its slots are empty
                if dropped:
                    log.warning("node.sessions_dropped", engine=engine_id, sessions=len(dropped))
            elif await registry.heartbeat(engine_id, ttl_s=ttl):
                return
            await registry.register(
                engine_id,
                node=self.settings.node_id,
                url=snap.url or "",
                model=snap.model_id,
                n_slots=snap.n_slots,
                ttl_s=ttl,
                instance=snap.instance,
                role=snap.role,
            )
            registered[engine_id] = snap.pid
        elif engine_id in registered:
            await registry.unregister(engine_id)
            del registered[engine_id]
            if snap.state is State.CRASHED:
                await self.parts.index.drop_engine(engine_id)

    async def _flush_loop(self) -> None:
        """Upload what the cache holds unconfirmed, backing off while that fails. It must outlive
        any failure: a loop that ended would leave every later spill unstored until the drain."""
        base = delay = self.settings.flush_interval_s
        while True:
            await asyncio.sleep(delay)
            pending = self.parts.cache.pending()
            if not pending:
                delay = base
                continue
            t0 = time.monotonic()
            log.info("node.flushing", files=len(pending))
            try:
                done = await self.parts.cache.flush(self.parts.store)
                log.info("node.flushed", files=len(done), ms=round((time.monotonic() - t0) * 1000, 1))
                delay = base
            except StorageError as exc:  # down (StoreUnavailable), or a conflicting object
                delay = min(delay * 2, base * 4)
                log.warning("node.flush_failed", error=str(exc), retry_in_s=delay)
            except Exception as exc:  # a bug or a local fault (a file gone): logged, and tried again
                delay = min(delay * 2, base * 4)
                log.exception("node.flush_error", error=repr(exc), retry_in_s=delay)


def _describe(paths: list[Path]) -> list[tuple[int, int, str, float] | None]:
    """Size, tokens, model fingerprint and save time of each slot file (None: gone or unreadable)."""
    out: list[tuple[int, int, str, float] | None] = []
    for path in paths:
        try:
            sf = read_slot_file(path, checksum=False)
            out.append((sf.size, sf.n_tokens, sf.fingerprint or "", path.stat().st_mtime))
        except (OSError, StorageError):
            out.append(None)
    return out


def _clear_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for entry in path.iterdir():
        if entry.is_file():
            entry.unlink()

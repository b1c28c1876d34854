"""One turn of a session, carried out: resolve it, lock it, place it, restore it, and after the
answer record it (idle LRU, routing digests, write-behind save) and unlock it.

Decisions are the pure functions of gateway.placement and gateway.prefixes; this module performs
them against the index, the node agents and the engines. Every state change is a log event.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import structlog

from engine_pool.errors import Conflict, NotFound, QuotaExceeded, RateLimited, Unavailable
from engine_pool.pool.client import NodeClient, NodeError, SpillResult
from gateway.cluster import Cluster, EngineRef
from gateway.early import Admission, EarlyStart, early_start
from gateway.holds import Holds, Phase, SessionHold
from gateway.metrics import Metrics
from gateway.placement import (
    LiveSlotsExhausted,
    NoCapacity,
    Placement,
    Serve,
    SessionView,
    choose_placement,
    prefix_slots,
    reserved,
)
from gateway.prefixes import finished_digests, lookup_digests, prefix_digests, prompt_digest, system_digest
from gateway.relay import TurnOutcome
from gateway.reservations import SlotReservations
from gateway.session_keys import session_key
from gateway.tenants import Durability, Tenant, Tenants
from storage.blobstore import BlobStore, delete_generations
from storage.errors import Conflict as RecordConflict
from storage.errors import LockBusy, LockLost, StorageError
from storage.errors import NotFound as RecordNotFound
from storage.ids import validate_id
from storage.index import Decide, SessionIndex, SessionRecord, SessionState
from storage.locks import SessionLock, SessionLocks
from storage.turnops import Ops, TurnStart

log = structlog.get_logger("slotkeeper.gateway")
_GENERATION_TRIES = 8


@dataclass
class Turn:
    tenant: Tenant
    session: str
    model: str
    hold: SessionHold  # the session's lock, shared with this turn's write-behind save
    placement: Placement
    engine_url: str
    node: NodeClient
    source: str  # how the session was found (gateway.session_keys), or implicit | new | fork
    forked_from: str | None = None
    inflight: str = ""  # the tenant's in-flight place this turn holds (given back by `finish`)
    settled: bool = False  # `finish_soon` ran
    early: bool = False  # the call `begin` launched before its opening read is this turn's (confirmed)
    shared: str | None = None  # its shared prefix's digest, to record for other sessions (or None)
    prompt: RestorePrompt | None = None  # what it was placed for (its tools name its prompt's digest)

    @property
    def lock(self) -> SessionLock:
        return self.hold.lock


def fork_id(session: str) -> str:
    """A fresh id for a fork of `session`: valid whatever the parent's id ends with, at most 128
    characters (a parent like `dot2.` would otherwise give `dot2..fXXXX`, which ids refuse)."""
    base = session[:110].rstrip(".") or "s"
    return validate_id(f"{base}.f{secrets.token_hex(4)}", "fork id")


def _marked_there(record: SessionRecord, placement: Placement, model: str) -> bool:
    """Whether the busy mark the opening read wrote on ``record`` is what placing the turn wrote:
    served live in the same slot of the same model (the mark changed only its last use and dirt)."""
    return (
        placement.serve is Serve.LIVE
        and record.state is SessionState.LIVE
        and (record.engine, record.slot) == (placement.engine, placement.slot)
        and record.model == model
    )


@dataclass(frozen=True)
class RestorePrompt:
    """The prompt a turn is placed for, as far as a restore can use it: a conversation that leaves
    the stored one before its end (an edited earlier message, a retry from far back) needs only
    the stored part up to the checkpoint the engine continues from, and the node can cut the
    generation there given the prompt's tokens. ``tokens(engine_url)`` asks that engine for them
    (None when it cannot say)."""

    messages: Sequence[Mapping[str, Any]]
    tokens: Callable[[str], Awaitable[list[int] | None]]
    shared: Callable[[], str | None] = lambda: None  # the digest of its shared prefix (computed once)
    tools: Any = None  # as sent

    def sources(self, model: str) -> list[str]:
        """The digests a session without state of its own may start from, best first: this very
        prompt's (sent again), then its shared prefix's (gateway.prefixes)."""
        whole = prefix_digests(self.messages, model)[-1:]
        return [d for d in (*(prompt_digest(w, self.tools) for w in whole), self.shared()) if d]

    def leaves(self, record: SessionRecord, model: str) -> bool:
        """Whether the prompt leaves the stored conversation before its end: its complete turns do
        not include the conversation the session was saved at (its routing digest). A prompt that
        goes on from there gets the whole generation, without asking for tokens."""
        return bool(record.route) and record.route not in lookup_digests(self.messages, model)


class TurnRunner:
    def __init__(
        self,
        cluster: Cluster,
        index: SessionIndex,
        locks: SessionLocks,
        store: BlobStore,
        nodes: dict[str, NodeClient],
        metrics: Metrics,
        *,
        lock_ttl_s: float,
        spill_wait_s: float,
        save_grace_s: float = 0.0,
        early_start: bool = True,
        internal_key: str | None = None,
        keep_generations: int = 2,
        tenants: Tenants | None = None,
        superseded: Callable[[str], None] | None = None,
        max_inflight: int = 64,
        inflight_ttl_s: float = 660.0,
    ) -> None:
        self.cluster = cluster
        self.store = store
        self.metrics = metrics
        self.index = index
        self.locks = locks
        self.nodes = nodes  # node id -> client
        self.lock_ttl_s = lock_ttl_s
        self.early_start = early_start  # launch a held session's turn beside its opening read
        self.spill_wait_s = spill_wait_s
        self.internal_key = internal_key
        self.keep_generations = keep_generations
        self.tenants = tenants
        self._superseded = superseded  # told the tenant whose stored generations were deleted
        self.max_inflight = max_inflight  # a tenant's in-flight places unless its quota says
        self.inflight_ttl_s = inflight_ttl_s  # a place lapses after this (its gateway died)
        self.holds = Holds(locks, lock_ttl_s, save_grace_s)  # the session locks this process holds
        self._tasks: set[asyncio.Task[None]] = set()  # bookkeeping in flight (finish_soon)
        self._reserved = SlotReservations()  # slots chosen here, not yet recorded as taken
        self._admission: dict[str, Admission] = {}  # by tenant (names from the tenants file: bounded)

    # ---------------------------------------------------------------------------------- resolve
    async def resolve(
        self, tenant: Tenant, headers: Mapping[str, str], body: Mapping[str, Any], model: str
    ) -> tuple[str, str]:
        """The session a request names (gateway.session_keys), finds implicitly, or a new one."""
        messages = body.get("messages")

        def scope() -> str | None:  # an agent's conversations: one session per system prompt
            return system_digest(messages) if isinstance(messages, list) else None

        explicit, source = session_key(headers, body, scope)
        if explicit is not None:
            return explicit, source
        if isinstance(messages, list):
            hit = await self.index.match_prefix(tenant.name, lookup_digests(messages, model))
            if hit is not None:
                return hit[1], "implicit"
        return "s-" + secrets.token_hex(12), "new"

    # ------------------------------------------------------------------------------------ begin
    async def begin(
        self, tenant: Tenant, session: str, model: str, source: str, prompt: RestorePrompt | None = None,
        launch: Callable[[EarlyStart], None] | None = None,
    ) -> Turn:  # fmt: skip
        """Admit the turn (rate window, in-flight place), lock and place its session, and mark it
        live in its slot. A warm turn (the session live in its slot) makes one Redis round trip
        here: the opening read (storage.turnops), which also marks it busy there. A session whose
        previous turn's save this process still holds is taken over from that save first, so the
        opening read confirms the lock instead of taking it — and, given ``launch``, the turn is
        sent to its slot before that read (``launch(where)``, gateway.early): ``Turn.early`` then
        says whether the read confirmed it (else the caller abandons that call)."""
        q = tenant.quotas
        limit = q.inflight or self.max_inflight
        own = self.holds.get(tenant.name, session)
        if own is not None and not await self.holds.take_over(own):
            own = None  # a request runs on it (forked below) or it was released (locked below)
        admission = self._admission.setdefault(tenant.name, Admission())
        early = None
        try:
            if own is not None and launch is not None and self.early_start:
                if admission.room(q.requests_per_minute, limit, time.time()):
                    early = self._early_start(own, model)
                    if early is not None:
                        launch(early)
            async with own.writing() if own is not None else contextlib.nullcontext():
                start = await self.index.start_turn(
                    tenant.name, session, lock_ttl_s=self.lock_ttl_s, inflight_limit=limit,
                    inflight_ttl_s=self.inflight_ttl_s, rpm_limit=q.requests_per_minute,
                    own_lock=own.lock if own is not None else None,
                )  # fmt: skip
                if own is not None and start.kept:
                    own.record = start.record
            admission.seen(start, time.time())
        except BaseException:
            if own is not None:
                await self.holds.let_go(own, turn=True)
            raise
        if own is not None and not start.kept:  # refused, or its lock lapsed (the keeper says so)
            await self.holds.let_go(own, turn=True)
            own = None
        if start.refused == "rate":
            raise QuotaExceeded(f"tenant {tenant.name} exceeded {q.requests_per_minute} requests per minute",
                                retry_after=60 - time.time() % 60)  # fmt: skip
        if start.refused == "inflight":
            raise RateLimited(f"tenant {tenant.name} already has {limit} requests running", retry_after=1)
        self.cluster.saw_epoch(start.registry_epoch)
        try:
            return await self._begin(tenant, session, model, source, start, own, prompt, early)
        except BaseException:
            with contextlib.suppress(StorageError):  # Redis away: the place lapses with its TTL
                await self.index.release_inflight(tenant.name, start.inflight_token)
            raise

    def _early_start(self, own: SessionHold, model: str) -> EarlyStart | None:
        rec = own.record
        engine = self.cluster.cached_engine(rec.engine) if rec is not None and rec.engine else None
        return early_start(own, engine, model, time.monotonic(), margin_s=self.lock_ttl_s / 3)

    async def _begin(
        self, tenant: Tenant, session: str, model: str, source: str, start: TurnStart,
        own: SessionHold | None, prompt: RestorePrompt | None, early: EarlyStart | None = None,
    ) -> Turn:  # fmt: skip
        hold = own or await self._hold(tenant.name, session, start)
        busy = start.busy  # the opening read marked the session busy in its live slot
        forked_from = None
        if hold is None:  # busy with another request: fork it
            forked_from, session = session, fork_id(session)
            lock = await self.locks.try_acquire(tenant.name, session, ttl_s=self.lock_ttl_s)
            assert lock is not None
            hold = self.holds.start(lock, None)
            source = "fork"
            busy = False
        created = False
        try:
            record = hold.record
            if record is None and hold.lock is not start.lock:  # the opening read's record is current
                record = await self.index.find(tenant.name, session)
            if record is None:
                self._check_new_session_quota(tenant, start)
                record = await self.index.create(tenant.name, session, model=model)
                hold.record, created = record, True
            placement, engine_url, node = await self._place(tenant, record, model, forked_from, hold, prompt)
            marked = busy and _marked_there(record, placement, model)
            confirmed = (
                early is not None and marked and hold is own and start.kept
                and (placement.engine, placement.slot, engine_url) == (early.engine, early.slot, early.url)
                and getattr(self.cluster.cached_engine(early.engine), "instance", None) == early.instance
            )  # fmt: skip
            try:
                if not marked:
                    decide = self.index.decide_live(
                        tenant.name, session, engine=placement.engine, slot=placement.slot,
                        tokens=record.tokens, model=model,
                    )  # fmt: skip
                    await self._write(hold, decide, idle=False)
                busy = False  # the record says where the turn runs
            finally:  # recorded there now (or failed): the index says who holds the slot
                self._reserved.release((placement.engine, placement.slot))
            # A turn on its live slot (the common case) is counted (`served`), not logged at info.
            (log.debug if placement.serve is Serve.LIVE else log.info)(
                "session.placed",
                tenant=tenant.name,
                session=session,
                engine=placement.engine,
                slot=placement.slot,
                serve=placement.serve.value,
                source=source,
            )
            # A session records its shared prefix when a turn places it in a slot (new, restored,
            # forked): a warm turn does not hash its tools and system prompt again.
            shared = None
            if prompt is not None and placement.serve is not Serve.LIVE and self._shares(tenant.name):
                shared = prompt.shared()
            return Turn(tenant, session, model, hold, placement, engine_url, node, source, forked_from,
                        start.inflight_token, early=confirmed, shared=shared, prompt=prompt)  # fmt: skip
        except BaseException:
            try:
                if created:  # a failed placement leaves no record behind (it would count toward quotas)
                    with contextlib.suppress(StorageError):
                        await self.index.delete(tenant.name, session, lock=hold.lock)
                elif busy:  # marked busy by the opening read, but no turn runs: idle in its slot again
                    with contextlib.suppress(StorageError):
                        await self._write(hold, self.index.decide_idle(session), idle=True)
            finally:  # (also when cancelled meanwhile: the lock is never left held)
                await self.holds.let_go(hold, turn=True)
            raise

    async def _hold(self, tenant: str, session: str, start: TurnStart) -> SessionHold | None:
        """The session's lock for this turn when this process did not hold it already: taken by
        the opening read, taken over from this process's own previous turn of the session (one
        that began settling meanwhile), or waited for; None when a request runs on it (the caller
        forks)."""
        if start.lock is not None:
            return self.holds.start(start.lock, start.record)
        own = self.holds.get(tenant, session)
        if own is not None and await self.holds.take_over(own):
            return own
        lock = await self._lock(tenant, session)
        return None if lock is None else self.holds.start(lock, None)

    async def _lock(self, tenant: str, session: str) -> SessionLock | None:
        """The session's lock, waiting where its holder is only settling or dead; None when a live
        request holds it (the caller forks)."""
        lock = await self.locks.try_acquire(tenant, session, ttl_s=self.lock_ttl_s)
        if lock is not None:
            return lock
        own = self.holds.get(tenant, session)
        if own is not None:  # our own: a turn runs on it (fork), or it is being released (wait)
            if own.phase is Phase.RUNNING:
                return None
            wait = self.spill_wait_s
        elif await self.index.find(tenant, session) is None or await self.index.is_idle(tenant, session):
            # No request runs on it: a delete, an eviction or another replica's save of its last turn
            # holds the lock a moment. There is nothing to fork from anyway: wait.
            wait = self.spill_wait_s
        else:
            left = await self.locks.remaining_s(tenant, session)
            # A live holder renews every third of the TTL, so its lock never runs below two thirds; one
            # below half was not renewed in time: its gateway died. Wait for it to lapse, never fork.
            if left is not None and left >= self.lock_ttl_s / 2:
                return None
            wait = (left or 0.0) + 1.0
        with contextlib.suppress(LockBusy):
            return await self.locks.acquire(tenant, session, ttl_s=self.lock_ttl_s, wait_s=wait)
        return None

    def _check_new_session_quota(self, tenant: Tenant, start: TurnStart) -> None:
        """From the counts the opening read returned (O(1) each)."""
        q = tenant.quotas
        if q.sessions is not None and start.sessions >= q.sessions:
            raise QuotaExceeded(
                f"tenant {tenant.name} has reached its limit of {q.sessions} sessions", retry_after=60
            )
        if q.stored_bytes is not None and start.stored_bytes >= q.stored_bytes:
            raise QuotaExceeded(
                f"tenant {tenant.name} stores {q.stored_bytes} bytes of sessions, its limit: delete sessions "
                "to start new ones",
                retry_after=60,
            )

    async def _write(
        self,
        hold: SessionHold,
        decide: Decide,
        *,
        idle: bool | None = None,
        also: Callable[[Ops], None] | None = None,
    ) -> tuple[SessionRecord, bool]:
        """One transition of the held session's record: a one-round-trip compare-and-set against
        the record this process last saw (with `also`'s writes), else the transaction. Returns the
        new record and whether `also`'s writes were made (the caller makes them otherwise)."""
        lock = hold.lock
        async with hold.writing():
            new = None
            if hold.record is not None:
                new = await self.index.apply(hold.record, decide, lock=lock, idle=idle, also=also)
            done = new is not None
            if new is None:
                new = await self.index.transition(lock.tenant, lock.session, decide, lock=lock, idle=idle)
            hold.record = new
            return new, done

    async def _place(
        self, tenant: Tenant, record: SessionRecord, model: str, forked_from: str | None, hold: SessionHold,
        prompt: RestorePrompt | None = None,
    ) -> tuple[Placement, str, NodeClient]:  # fmt: skip
        if (
            forked_from is None
            and record.state is SessionState.LIVE
            and record.engine
            and record.slot is not None
        ):
            # Live in its slot (the common warm turn): the lock makes the slot ours, no snapshot.
            engine = await self.cluster.engine(record.engine)
            if engine is not None and engine.model == model and record.slot < engine.n_slots:
                self._reserved.hold((engine.engine, record.slot))
                try:
                    node = await self._node(engine.node)
                except BaseException:
                    self._reserved.release((engine.engine, record.slot))
                    raise
                return Placement(engine.engine, record.slot, Serve.LIVE), engine.url, node
        if hold.saved is not None and not hold.saved.done():
            # Served elsewhere: it needs the state its previous turn is saving right now.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(hold.saved), self.spill_wait_s)
            record = await self.index.get(record.tenant, record.session)
            hold.record = record
        return await self._place_by_snapshot(tenant, record, model, forked_from, prompt)

    async def _place_by_snapshot(
        self, tenant: Tenant, record: SessionRecord, model: str, forked_from: str | None,
        prompt: RestorePrompt | None = None,
    ) -> tuple[Placement, str, NodeClient]:  # fmt: skip
        source = forked_from or record.session
        generation = record.generation
        shares = self._shares(tenant.name)
        # The session whose state this one may start from: the parent of a fork, or — a session
        # with no state of its own — the one holding its shared prefix (gateway.prefixes).
        holder = None
        if forked_from:
            holder = await self.index.find(tenant.name, forked_from)
            generation = holder.generation if holder else 0
        elif not generation and shares and prompt is not None:
            # (The digests are the model's: a holder's stored state is of it too. A reindexed record
            # names the model by its fingerprint; the engine checks that when it restores.)
            for digest in prompt.sources(model):
                holder = await self.index.find_shared(tenant.name, digest)
                if holder is not None and holder.session != record.session:
                    break
                holder = None
        prefer = holder.engine if holder is not None and holder.live and holder.model == model else None
        view = SessionView(tenant.name, record.session, record.engine, record.slot, generation)
        started = self._reserved.start_snapshot()
        try:
            snapshot, refs = await self.cluster.snapshot(
                model,
                holder=(tenant.name, record.session),
                with_tenant_engines=tenant.quotas.live_slots is not None,
                also=prefer,
            )
            # No await from here to the reservation: what this choice sees and the slot it holds
            # are one step for every other placement of this process (gateway.reservations).
            views = reserved(snapshot, self._reserved.taken(started))
            placement = choose_placement(views, model, view, tenant.quotas.live_slots, prefer=prefer)
            self._reserved.hold((placement.engine, placement.slot))
        except NoCapacity as exc:
            raise Unavailable(f"no free slot for model {model!r}: {exc}", retry_after=2) from None
        except LiveSlotsExhausted as exc:
            raise QuotaExceeded(str(exc), retry_after=2) from None
        finally:
            self._reserved.end_snapshot(started)
        try:
            engine = refs[placement.engine]
            node = await self._node(engine.node)
            here = next(v for v in views if v.engine == placement.engine)
            sources = prefix_slots(here, tenant.name, placement.slot) if shares else ()
            live_here = holder is not None and holder.live and holder.engine == placement.engine
            if forked_from and holder is not None and live_here:
                # The parent's slot is on this engine: the fork starts from its live state there.
                sources = tuple(dict.fromkeys((*sources, *(() if holder.slot is None else (holder.slot,)))))
                placement = replace(placement, serve=Serve.COLD)
            placement = replace(placement, prefix_slots=sources)
            # The holder's state is in one of those slots, or in this one (evicted from it, kept).
            if holder is not None and live_here and placement.serve is Serve.COLD:
                victim = placement.evict
                evicted = victim is not None and (victim.tenant, victim.session) == (
                    tenant.name,
                    holder.session,
                )
                if holder.slot in sources or evicted:
                    placement = replace(placement, prefix_from=holder.session)
            if placement.evict is not None:
                await self._evict(engine.engine, node, placement)
            try:
                if placement.serve is Serve.RESTORE:
                    tokens = None
                    if prompt is not None and not forked_from and prompt.leaves(record, model):
                        tokens = await prompt.tokens(engine.url)  # only what the prompt continues from
                    await node.fill(
                        engine.engine,
                        placement.slot,
                        tenant=tenant.name,
                        session=source,
                        generation=generation,
                        tokens=tokens,
                    )
                elif placement.serve is Serve.COLD:
                    placement = await self._prepare_cold(tenant.name, engine, node, placement, holder, prompt)
            except NodeError as exc:
                if placement.serve is Serve.RESTORE and exc.status < 500:
                    log.warning(
                        "session.restore_failed", tenant=tenant.name, session=record.session, error=str(exc)
                    )
                    self.metrics.restore_failures.inc()
                    await node.erase(engine.engine, placement.slot)
                    placement = replace(placement, serve=Serve.COLD, prefix_from=None, prefix_stored=False)
                else:  # the node or its store is down: this request fails, the session stays as it was
                    raise Unavailable(f"could not prepare the slot: {exc.message}", retry_after=1) from exc
        except BaseException:
            self._reserved.release((placement.engine, placement.slot))
            raise
        return placement, engine.url, node

    async def _prepare_cold(
        self, tenant: str, engine: EngineRef, node: NodeClient, placement: Placement,
        holder: SessionRecord | None, prompt: RestorePrompt | None,
    ) -> Placement:  # fmt: skip
        """The slot of a session with no state of its own, made ready: filled with the stored
        prefix of the session holding its shared prefix when that one is not live on this engine
        (``prefix_from``: the engine continues from its checkpoint), else cleared — unless it
        holds the tenant's own session just evicted from it, whose state the engine may start from
        as from any of the tenant's slots (never another tenant's)."""
        live_here = holder is not None and holder.live and holder.engine == engine.engine
        if holder is not None and not live_here and holder.generation and prompt is not None:
            tokens = await prompt.tokens(engine.url)
            if tokens:
                try:
                    out = await node.fill(
                        engine.engine, placement.slot, tenant=tenant, session=holder.session,
                        generation=holder.generation, tokens=tokens, prefix=True,
                    )  # fmt: skip
                except NodeError as exc:
                    # Damaged, gone, or the store away: the prompt is evaluated in full instead (the
                    # same answer), and the slot is cleared below (a node that is down fails there).
                    log.warning(
                        "session.prefix_fill_failed", tenant=tenant, holder=holder.session, error=str(exc)
                    )
                    self.metrics.restore_failures.inc()
                else:
                    if out.source != "none":
                        return replace(placement, prefix_from=holder.session, prefix_stored=True)
        victim = placement.evict
        if victim is None or victim.tenant != tenant or not self._shares(tenant):
            # A slot is never shared across tenants: clear what a dropped session left behind.
            await node.erase(engine.engine, placement.slot)
        return placement

    async def _evict(self, engine: str, node: NodeClient, placement: Placement) -> None:
        """Spill the placement's victim out of its slot; any failure costs this request only (503)
        and leaves the victim live where it was."""
        victim = placement.evict
        assert victim is not None and victim.tenant and victim.session
        try:  # an idle victim may still be saving its last turn: wait for that, not longer
            lock = await self.locks.acquire(
                victim.tenant, victim.session, ttl_s=self.lock_ttl_s, wait_s=self.spill_wait_s
            )
        except LockBusy:
            raise Unavailable("the slot chosen for eviction stayed busy; retry", retry_after=1) from None
        try:
            rec = await self.index.get(victim.tenant, victim.session)
            if (rec.state, rec.engine, rec.slot) != (SessionState.LIVE, engine, victim.slot):
                # It moved while we waited for its lock (its own next turn took it elsewhere):
                # the slot no longer holds it, and saving the slot would give it someone else's state.
                raise Unavailable("the slot chosen for eviction changed hands; retry", retry_after=1)
            if rec.generation and not rec.dirty:
                # Its after-turn save is its current state: nothing to save again.
                await self.index.mark_spilled(victim.tenant, victim.session, generation=rec.generation,
                                              blob_key=rec.blob_key, nbytes=rec.bytes, lock=lock)  # fmt: skip
                self.metrics.evictions.inc()
                log.info("session.evicted", tenant=victim.tenant, session=victim.session, engine=engine,
                         slot=victim.slot, generation=rec.generation, saved=False)  # fmt: skip
                return
            reserve = functools.partial(
                self.index.reserve_generation, victim.tenant, victim.session, lock=lock
            )
            out = await self._save(node, engine, victim.slot, victim.tenant, victim.session, rec, reserve)
            await self.index.mark_spilled(
                victim.tenant,
                victim.session,
                generation=out.generation,
                blob_key=out.key,
                nbytes=out.bytes,
                tokens=out.tokens,
                lock=lock,
            )
            self.metrics.evictions.inc()
            self.metrics.spilled("evict", out.bytes, out.ms, out.written)
            log.info("session.evicted", tenant=victim.tenant, session=victim.session, engine=engine,
                     slot=victim.slot, generation=out.generation)  # fmt: skip
        except (NodeError, StorageError) as exc:
            log.warning("session.evict_failed", tenant=victim.tenant, session=victim.session, engine=engine,
                        error=str(exc))  # fmt: skip
            raise Unavailable("could not make room for this session; retry", retry_after=1) from exc
        finally:
            with contextlib.suppress(StorageError):
                await self.locks.release(lock)

    def _shares(self, tenant: str) -> bool:
        """Whether the tenant's sessions share stored chunks (a tenants-file setting, default yes)."""
        known = self.tenants.by_name.get(tenant) if self.tenants is not None else None
        return known.share_chunks if known is not None else True

    async def _save(
        self, node: NodeClient, engine: str, slot: int, tenant: str, session: str, rec: SessionRecord,
        reserve: Callable[[], Awaitable[int]],
    ) -> SpillResult:  # fmt: skip
        """Save the slot as the session's next generation, a number the index hands out once per
        session id (`reserve`; also across a delete and a reuse of the id). A generation the node or
        the store holds already (a copy a crash left) is skipped for the next one, never overwritten."""
        for _ in range(_GENERATION_TRIES):
            generation = await reserve()
            try:
                return await node.spill(
                    engine, slot, tenant=tenant, session=session, generation=generation,
                    route=rec.stored_routes, share=self._shares(tenant),
                )  # fmt: skip
            except NodeError as exc:
                if exc.status != 409 or exc.code != "conflict":
                    raise
        raise Unavailable(
            f"session {session}: {_GENERATION_TRIES} generations in a row are taken", retry_after=1
        )

    async def _node(self, node_id: str) -> NodeClient:
        if node_id not in self.nodes:
            url = await self.cluster.node_url(node_id)
            if url is None:
                raise Unavailable(f"node {node_id} is not reachable", retry_after=2)
            self.nodes[node_id] = NodeClient(url, key=self.internal_key)
        return self.nodes[node_id]

    # ----------------------------------------------------------------------------------- finish
    def answered(self, turn: Turn) -> None:
        """The turn's answer is going out (call before it does): from now on a request for the
        session waits for this turn's bookkeeping (`finish`) instead of forking it."""
        self.holds.answered(turn.hold)

    def finish_soon(self, turn: Turn, messages: Sequence[Mapping[str, Any]], outcome: TurnOutcome) -> None:
        """`finish` as a task beside the answer going out (marked answered first, synchronously).
        Once per turn: a second call (a stream's end and its response's background both settle it)
        does nothing."""
        if turn.settled:
            return
        turn.settled = True
        self.answered(turn)
        task = asyncio.create_task(self.finish(turn, messages, outcome), name=f"finish:{turn.session}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def finish(self, turn: Turn, messages: Sequence[Mapping[str, Any]], outcome: TurnOutcome) -> None:
        """Bookkeeping after the engine answered (or failed): the record back to idle, the prefix
        routes, the usage counters, the in-flight place and — unless a write-behind save follows —
        the lock, all in one round trip (storage.turnops). Never raises: a fault here costs
        durability or routing of this one session, never the answer already given."""
        t, s, hold = turn.tenant.name, turn.session, turn.hold
        self.holds.answered(hold)
        save = outcome.ok and turn.tenant.durability is Durability.AFTER_TURN
        release = not save and self.holds.last_user(hold)
        digests: list[str] = []
        usage: dict[str, int] = {}
        identical = None  # this prompt's digest, for a new session that sends it again
        if outcome.ok:
            tools = turn.prompt.tools if turn.prompt is not None else None
            digests, identical = finished_digests(messages, outcome.assistant_message(), tools, turn.model)
            if not self._shares(t):
                identical = None
            usage = {
                "requests": 1,
                "prompt_tokens": int(outcome.usage.get("prompt_tokens", 0)),
                "completion_tokens": int(outcome.usage.get("completion_tokens", 0)),
            }

        shared = turn.shared if outcome.ok else None

        def also(ops: Ops) -> None:
            if digests:
                self.index.queue_prefixes(ops, t, s, digests)
            for digest in (shared, identical):
                if digest:
                    self.index.queue_shared(ops, t, s, digest)
            if usage:
                self.index.queue_usage(ops, t, usage)
            if turn.inflight:
                self.index.queue_release_inflight(ops, t, turn.inflight)
            if release:
                ops.delete(self.index.keys.lock(t, s))

        decide = self.index.decide_idle(
            s, outcome.tokens or None, digests[-1] if digests else None, shared, identical
        )
        written = released = False
        try:
            _, written = await self._write(hold, decide, idle=True, also=also)
            released = written and release
            if not outcome.ok:
                # A failed or timed-out request fails alone. Whether the engine died is the node's to
                # say (process exit, failed health, re-registration drop its sessions), not ours.
                log.warning("session.turn_failed", tenant=t, session=s, error=outcome.error)
            if not written:  # the record changed under us: the transaction wrote it; now the rest
                if digests:
                    await self.index.add_prefixes(t, s, digests)
                for digest in (shared, identical):
                    if digest:
                        await self.index.add_shared(t, s, digest)
                if usage:
                    await self.index.incr_usage(t, usage)
            if save:
                self.holds.saving(hold, functools.partial(self._write_behind, turn))
        except LockLost:
            log.warning("session.lock_lost", tenant=t, session=s)
        except (RecordConflict, RecordNotFound):
            # The node dropped the session meanwhile (its engine died) or it was deleted: nothing to keep.
            log.info("session.gone_after_turn", tenant=t, session=s)
        except StorageError as exc:
            log.warning("session.finish_failed", tenant=t, session=s, error=str(exc))
        finally:
            if turn.inflight and not written:
                with contextlib.suppress(StorageError):
                    await self.index.release_inflight(t, turn.inflight)
            self.holds.booked(hold)
            await self.holds.let_go(hold, released=released)

    async def _write_behind(self, turn: Turn) -> None:
        t, s, hold = turn.tenant.name, turn.session, turn.hold
        try:
            # The index, not this process's copy: the node may have dropped the session meanwhile
            # (its engine died), and a slot of a restarted engine holds someone else's state.
            rec = await self.index.get(t, s)
            hold.record = rec
            if rec.state is not SessionState.LIVE or (rec.engine, rec.slot) != (
                turn.placement.engine,
                turn.placement.slot,
            ):
                return
            limit = turn.tenant.quotas.stored_bytes
            if limit is not None and await self.index.stored_bytes(t) >= limit:
                self.metrics.saves_skipped.labels("stored_bytes").inc()
                log.warning(
                    "session.save_skipped", tenant=t, session=s, reason="stored_bytes quota", limit=limit
                )
                return
            since = rec.last_used  # a turn that runs meanwhile changes it: the record stays dirty

            async def reserve() -> int:
                record, _ = await self._write(hold, self.index.decide_reserve(s))
                return record.reserved

            out = await self._save(turn.node, turn.placement.engine, turn.placement.slot, t, s, rec, reserve)
            where = (turn.placement.engine, turn.placement.slot)
            durable = self.index.decide_durable(
                s, generation=out.generation, blob_key=out.key, nbytes=out.bytes, since=since, slot=where
            )
            await self._write(hold, durable)
            self.metrics.spilled("after-turn", out.bytes, out.ms, out.written)
            log.info("session.durable", tenant=t, session=s, generation=out.generation, bytes=out.bytes,
                     written=out.written, uploaded=out.uploaded)  # fmt: skip
            # The newest K stay (the one before may be what a fork is filling from); older ones go.
            if await delete_generations(self.store, t, s, below=out.generation - self.keep_generations + 1):
                self._told_superseded(t)
        except Exception as exc:  # the turn was answered; a failed save only costs durability
            log.warning("session.write_behind_failed", tenant=t, session=s, error=str(exc))

    def _told_superseded(self, tenant: str) -> None:
        if self._superseded is not None:
            self._superseded(tenant)

    async def settled(self, tenant: str, session: str) -> None:
        """Wait until this process's last turn of the session has written its bookkeeping (what
        a read of the session right after an answer must see)."""
        hold = self.holds.get(tenant, session)
        if hold is not None and hold.phase is Phase.ANSWERED:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(hold.booked.wait(), self.spill_wait_s)

    async def drain(self) -> None:
        """Wait for the bookkeeping and write-behind saves in flight (shutdown)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.holds.drain()

    # ----------------------------------------------------------------------------------- delete
    async def delete(self, tenant: Tenant, session: str) -> SessionRecord:
        """Remove every copy: the slot, each node's spill cache (pending uploads too), every stored
        generation and the index record. A later request with the same id starts a new session."""
        rec = await self.index.find(tenant.name, session)
        if rec is None:
            raise NotFound(f"session {session} not found")
        try:
            lock = await self.locks.acquire(tenant.name, session, ttl_s=self.lock_ttl_s)
        except LockBusy:
            # A request runs on it: whoever waits for that answer is told the session is going, so
            # its generation ends now (the turn then saves and lets go of the lock, or fails).
            await self._cancel_turn(rec)
            try:
                lock = await self.locks.acquire(
                    tenant.name, session, ttl_s=self.lock_ttl_s, wait_s=self.spill_wait_s
                )
            except LockBusy:
                raise Conflict(f"session {session} is busy with a request; retry", retry_after=1) from None
        try:
            if rec.state is SessionState.LIVE and rec.engine is not None and rec.slot is not None:
                engine = await self.cluster.engine(rec.engine)
                if engine is not None:
                    node = await self._node(engine.node)
                    await node.erase(engine.engine, rec.slot)
            for node in await self._all_nodes():
                await node.forget(tenant.name, session)
            await delete_generations(self.store, tenant.name, session)
            await self.index.delete(tenant.name, session, lock=lock)
            self._told_superseded(tenant.name)
        except NodeError as exc:
            raise Unavailable(f"could not delete every copy of session {session}: {exc.message}",
                              retry_after=1) from exc  # fmt: skip
        finally:
            with contextlib.suppress(StorageError):
                await self.locks.release(lock)
        log.info("session.deleted", tenant=tenant.name, session=session)
        return rec

    async def _cancel_turn(self, rec: SessionRecord) -> None:
        """End the generation on the session's slot, when it is live there (a session being placed
        has none yet: its turn is waited for)."""
        if rec.state is not SessionState.LIVE or rec.engine is None or rec.slot is None:
            return
        engine = await self.cluster.engine(rec.engine)
        if engine is None:
            return
        with contextlib.suppress(NodeError):  # (then the wait for the lock decides)
            node = await self._node(engine.node)
            if await node.cancel(engine.engine, rec.slot):
                log.info("session.turn_cancelled", tenant=rec.tenant, session=rec.session, reason="delete")

    async def _all_nodes(self) -> list[NodeClient]:
        await self.cluster.refresh_nodes()
        return [await self._node(node_id) for node_id in await self.cluster.node_ids()]

"""One turn of a session, carried out: resolve it, lock it, place it, restore it, and after the
answer record it (idle LRU, routing digests, write-behind save) and unlock it.

Decisions are the pure functions of gateway.placement and gateway.prefixes; this module performs
them against the index, the node agents and the engines. Every state change is a log event.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from engine_pool.node_client import NodeClient, NodeError
from gateway.cluster import Cluster
from gateway.errors import BadRequest, NotFound, QuotaExceeded, Unavailable
from gateway.metrics import Metrics
from gateway.placement import NoCapacity, Placement, Serve, SessionView, choose_placement
from gateway.prefixes import lookup_digests, turn_digests
from gateway.relay import TurnOutcome
from gateway.tenants import Durability, Tenant
from storage.blobstore import BlobStore
from storage.errors import InvalidId, LockBusy, LockLost
from storage.ids import validate_id
from storage.index import SessionIndex, SessionRecord, SessionState
from storage.locks import SessionLock, SessionLocks

log = structlog.get_logger("slotkeeper.gateway")


@dataclass
class Turn:
    tenant: Tenant
    session: str
    model: str
    lock: SessionLock
    placement: Placement
    engine_url: str
    node: NodeClient
    source: str  # how the session was found: header | prompt_cache_key | implicit | new | fork
    forked_from: str | None = None


def session_from_request(headers: Mapping[str, str], body: Mapping[str, Any]) -> tuple[str | None, str]:
    """The explicit session id of a request (X-Session-Id, then prompt_cache_key), or None."""
    header = headers.get("x-session-id")
    if header:
        try:
            return validate_id(header.strip(), "X-Session-Id"), "header"
        except InvalidId as exc:
            raise BadRequest(str(exc), param="X-Session-Id") from None
    key = body.get("prompt_cache_key")
    if key is not None:
        if not isinstance(key, str) or not key:
            raise BadRequest("prompt_cache_key must be a non-empty string", param="prompt_cache_key")
        return "pck-" + hashlib.sha256(key.encode()).hexdigest()[:40], "prompt_cache_key"
    return None, "implicit"


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
    ) -> None:
        self.cluster = cluster
        self.store = store
        self.metrics = metrics
        self.index = index
        self.locks = locks
        self.nodes = nodes  # node id -> client
        self.lock_ttl_s = lock_ttl_s
        self.spill_wait_s = spill_wait_s
        # Sessions whose turn ended here and whose lock is still held for the bookkeeping and the
        # write-behind save: a request for one of them waits for this instead of forking it.
        self._settling: dict[tuple[str, str], asyncio.Future[None]] = {}

    # ---------------------------------------------------------------------------------- resolve
    async def resolve(
        self, tenant: Tenant, headers: Mapping[str, str], body: Mapping[str, Any], model: str
    ) -> tuple[str, str]:
        explicit, source = session_from_request(headers, body)
        if explicit is not None:
            return explicit, source
        messages = body.get("messages")
        if isinstance(messages, list):
            hit = await self.index.match_prefix(tenant.name, lookup_digests(messages, model))
            if hit is not None:
                return hit[1], "implicit"
        return "s-" + secrets.token_hex(12), "new"

    # ------------------------------------------------------------------------------------ begin
    async def begin(self, tenant: Tenant, session: str, model: str, source: str) -> Turn:
        lock = await self.locks.try_acquire(tenant.name, session, ttl_s=self.lock_ttl_s)
        forked_from = None
        if lock is None:
            settling = self._settling.get((tenant.name, session))
            if settling is not None:  # our own previous turn is still saving: wait, then take over
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(settling), self.spill_wait_s)
                lock = await self.locks.try_acquire(tenant.name, session, ttl_s=self.lock_ttl_s)
            elif await self.index.is_idle(tenant.name, session):
                # No request runs on it: another gateway replica is saving its last turn. Wait.
                with contextlib.suppress(LockBusy):
                    lock = await self.locks.acquire(
                        tenant.name, session, ttl_s=self.lock_ttl_s, wait_s=self.spill_wait_s
                    )
        if lock is None:  # busy with another request: fork it
            forked_from, session = session, f"{session[:110]}.f{secrets.token_hex(4)}"  # ids: <= 128 chars
            lock = await self.locks.try_acquire(tenant.name, session, ttl_s=self.lock_ttl_s)
            assert lock is not None
            source = "fork"
        try:
            record = await self.index.find(tenant.name, session)
            if record is None:
                await self._check_new_session_quota(tenant)
                record = await self.index.create(tenant.name, session, model=model)
            placement, engine_url, node = await self._place(tenant, record, model, forked_from)
            await self.index.mark_live(
                tenant.name,
                session,
                engine=placement.engine,
                slot=placement.slot,
                tokens=record.tokens,
                model=model,
                lock=lock,
            )
            log.info(
                "session.placed",
                tenant=tenant.name,
                session=session,
                engine=placement.engine,
                slot=placement.slot,
                serve=placement.serve.value,
                source=source,
            )
            return Turn(tenant, session, model, lock, placement, engine_url, node, source, forked_from)
        except BaseException:
            await self.locks.release(lock)
            raise

    async def _check_new_session_quota(self, tenant: Tenant) -> None:
        limit = tenant.quotas.sessions
        if limit is not None and len(await self.index.list_sessions(tenant.name)) >= limit:
            raise QuotaExceeded(
                f"tenant {tenant.name} has reached its limit of {limit} sessions", retry_after=60
            )

    async def _place(
        self, tenant: Tenant, record: SessionRecord, model: str, forked_from: str | None
    ) -> tuple[Placement, str, NodeClient]:
        source = forked_from or record.session
        generation = record.generation
        if forked_from:
            base = await self.index.find(tenant.name, forked_from)
            generation = base.generation if base else 0
        view = SessionView(tenant.name, record.session, record.engine, record.slot, generation)
        try:
            snapshot, refs = await self.cluster.snapshot(model, holder=(tenant.name, record.session))
            placement = choose_placement(snapshot, model, view)
        except NoCapacity as exc:
            raise Unavailable(f"no free slot for model {model!r}: {exc}", retry_after=2) from None
        engine = refs[placement.engine]
        node = await self._node(engine.node)
        if placement.serve is not Serve.LIVE and tenant.quotas.live_slots is not None:
            live = sum(1 for e in snapshot for s in e.slots if s.tenant == tenant.name)
            if live >= tenant.quotas.live_slots and placement.evict is None:
                raise QuotaExceeded(
                    f"tenant {tenant.name} uses all of its {tenant.quotas.live_slots} live slots",
                    retry_after=2,
                )
        if placement.evict is not None:
            await self._evict(engine.engine, node, placement)
        try:
            if placement.serve is Serve.RESTORE:
                await node.fill(
                    engine.engine, placement.slot, tenant=tenant.name, session=source, generation=generation
                )
            elif placement.serve is Serve.COLD:
                # A slot is never shared across sessions: clear what a dropped session left behind.
                await node.erase(engine.engine, placement.slot)
        except NodeError as exc:
            if placement.serve is Serve.RESTORE:
                log.warning(
                    "session.restore_failed", tenant=tenant.name, session=record.session, error=str(exc)
                )
                self.metrics.restore_failures.inc()
                await node.erase(engine.engine, placement.slot)
                placement = Placement(placement.engine, placement.slot, Serve.COLD, placement.evict)
            else:
                raise Unavailable(f"could not prepare the slot: {exc}", retry_after=1) from exc
        return placement, engine.url, node

    async def _evict(self, engine: str, node: NodeClient, placement: Placement) -> None:
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
            if rec.generation and not rec.dirty:
                # Its after-turn save is its current state: nothing to save again.
                await self.index.mark_spilled(victim.tenant, victim.session, generation=rec.generation,
                                              blob_key=rec.blob_key, nbytes=rec.bytes, lock=lock)  # fmt: skip
                self.metrics.evictions.inc()
                log.info("session.evicted", tenant=victim.tenant, session=victim.session, engine=engine,
                         slot=victim.slot, generation=rec.generation, saved=False)  # fmt: skip
                return
            gen = rec.generation + 1
            out = await node.spill(
                engine,
                victim.slot,
                tenant=victim.tenant,
                session=victim.session,
                generation=gen,
                route=rec.route,
            )
            await self.index.mark_spilled(
                victim.tenant,
                victim.session,
                generation=gen,
                blob_key=out.key,
                nbytes=out.bytes,
                tokens=out.tokens,
                lock=lock,
            )
            self.metrics.evictions.inc()
            self.metrics.spilled("evict", out.bytes, out.ms)
            log.info(
                "session.evicted",
                tenant=victim.tenant,
                session=victim.session,
                engine=engine,
                slot=victim.slot,
                generation=gen,
            )
        finally:
            await self.locks.release(lock)

    async def _node(self, node_id: str) -> NodeClient:
        if node_id not in self.nodes:
            url = await self.cluster.node_url(node_id)
            if url is None:
                raise Unavailable(f"node {node_id} is not reachable", retry_after=2)
            self.nodes[node_id] = NodeClient(url)
        return self.nodes[node_id]

    # ----------------------------------------------------------------------------------- finish
    async def finish(self, turn: Turn, messages: Sequence[Mapping[str, Any]], outcome: TurnOutcome) -> None:
        """Bookkeeping after the engine answered (or failed); the lock is released when it and the
        write-behind save (after-turn tenants) are done."""
        t, s = turn.tenant.name, turn.session
        settled: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._settling[(t, s)] = settled  # before any await: the client may already send its next turn
        handed_off = False
        try:
            if outcome.engine_failed:
                # The engine died (its supervisor restarts it): every session it held falls back to
                # its last durable generation.
                await self.index.drop_engine(turn.placement.engine)
                log.warning("session.engine_failed", tenant=t, session=s, error=outcome.error)
                return
            if not outcome.ok:
                await self.index.mark_idle(t, s, lock=turn.lock)
                log.warning("session.turn_failed", tenant=t, session=s, error=outcome.error)
                return
            history = [*messages, outcome.assistant_message()]
            digests = turn_digests(history, turn.model)
            await self.index.add_prefixes(t, s, digests)
            route = digests[-1] if digests else None
            await self.index.mark_idle(t, s, tokens=outcome.tokens or None, route=route, lock=turn.lock)
            await self.index.incr_usage(
                t,
                {
                    "requests": 1,
                    "prompt_tokens": int(outcome.usage.get("prompt_tokens", 0)),
                    "completion_tokens": int(outcome.usage.get("completion_tokens", 0)),
                },
            )
            if turn.tenant.durability is Durability.AFTER_TURN:
                asyncio.create_task(self._write_behind(turn, settled))
                handed_off = True
        except LockLost:
            log.warning("session.lock_lost", tenant=t, session=s)
        finally:
            if not handed_off:
                await self._release(turn, settled)

    async def _release(self, turn: Turn, settled: asyncio.Future[None]) -> None:
        key = (turn.tenant.name, turn.session)
        try:
            await self.locks.release(turn.lock)
        finally:
            if self._settling.get(key) is settled:
                del self._settling[key]
            if not settled.done():
                settled.set_result(None)

    async def _write_behind(self, turn: Turn, settled: asyncio.Future[None]) -> None:
        t, s = turn.tenant.name, turn.session
        try:
            rec = await self.index.get(t, s)
            if rec.engine != turn.placement.engine or rec.slot != turn.placement.slot:
                return
            gen = rec.generation + 1
            out = await turn.node.spill(
                turn.placement.engine,
                turn.placement.slot,
                tenant=t,
                session=s,
                generation=gen,
                route=rec.route,
            )
            await self.index.set_durable(
                t, s, generation=gen, blob_key=out.key, nbytes=out.bytes, lock=turn.lock
            )
            self.metrics.spilled("after-turn", out.bytes, out.ms)
            log.info(
                "session.durable",
                tenant=t,
                session=s,
                generation=gen,
                bytes=out.bytes,
                uploaded=out.uploaded,
            )
        except Exception as exc:  # the turn was answered; a failed save only costs durability
            log.warning("session.write_behind_failed", tenant=t, session=s, error=str(exc))
        finally:
            await self._release(turn, settled)

    async def drain(self) -> None:
        """Wait for write-behind saves in flight (shutdown)."""
        if self._settling:
            await asyncio.gather(*self._settling.values(), return_exceptions=True)

    # ----------------------------------------------------------------------------------- delete
    async def delete(self, tenant: Tenant, session: str) -> SessionRecord:
        rec = await self.index.find(tenant.name, session)
        if rec is None:
            raise NotFound(f"session {session} not found")
        lock = await self.locks.acquire(tenant.name, session, ttl_s=self.lock_ttl_s, wait_s=self.spill_wait_s)
        try:
            if rec.state is SessionState.LIVE and rec.engine is not None and rec.slot is not None:
                engine = await self.cluster.engine(rec.engine)
                if engine is not None:
                    node = await self._node(engine.node)
                    await node.erase(engine.engine, rec.slot)
            refs = [info.ref async for info in self.store.list(tenant.name, session)]
            for ref in refs:
                await self.store.delete(ref)
            await self.index.delete(tenant.name, session, lock=lock)
        finally:
            await self.locks.release(lock)
        log.info("session.deleted", tenant=tenant.name, session=session)
        return rec

"""Retention: the gateway's one background loop over stored state.

At start and every ``collect_interval_s`` it visits each tenant the store holds: sessions idle
longer than the tenant's ``idle_ttl_s`` are deleted like a ``DELETE`` would (slot, node copies,
generations, record), then :meth:`ChunkedStore.collect` removes the pieces no manifest names and
rebuilds their reference counts. In between, a tenant whose generations were superseded or deleted
(:meth:`Retention.collect_soon`) gets :meth:`ChunkedStore.collect_unnamed`: the pieces whose count
fell to 0 go at once, without listing the tenant, so storage follows the sessions turn by turn.
Several gateway replicas may run it at once: the chunk ledger lets one collector per tenant in and
the others skip (``LockBusy``). A tenant whose collection was skipped so is not tried again for
``hold_off_s``: every try holds the tenant's saves back while it waits for those running. A failure
costs one tenant's turn of the loop, never the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import structlog

from engine_pool.errors import ApiError
from gateway.tenants import Tenant, Tenants
from storage.chunks.chunkstore import ChunkedStore
from storage.errors import LockBusy, NotStored, StorageError
from storage.index.session_index import SessionIndex

log = structlog.get_logger("slotkeeper.gateway")


class Retention:
    """Owner of the retention task; `collect_soon` asks for a tenant's collection ahead of time."""

    def __init__(
        self,
        store: ChunkedStore,
        index: SessionIndex,
        tenants: Tenants,
        *,
        interval_s: float,
        hold_off_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store, self.index, self.tenants = store, index, tenants
        self.interval_s, self.hold_off_s, self._clock = interval_s, hold_off_s, clock
        self._soon: set[str] = set()
        self._held_off: dict[str, float] = {}  # tenant -> when its next collection may be tried
        self._wake = asyncio.Event()

    def collect_soon(self, tenant: str) -> None:
        self._soon.add(tenant)
        self._wake.set()

    async def run(self, delete: Callable[[Tenant, str], Awaitable[object]]) -> None:
        """The loop; ``delete`` deletes one session everywhere (the turn runner's)."""
        next_full = self._clock()  # a full pass first: counts are rebuilt after a restart
        while True:
            if self.interval_s > 0 and self._clock() >= next_full:
                next_full = self._clock() + self.interval_s
                for name in sorted({t async for t in self.store.list_tenants()}):
                    await self.tend(name, delete)
            self._wake.clear()  # before draining: a request meanwhile wakes the next round
            for name in sorted(self._soon):
                if self._held_off.get(name, 0.0) > self._clock():
                    continue  # stays asked for
                self._soon.discard(name)
                if not await self._quietly(name, self.store.collect_unnamed(name)):
                    self._held_off[name] = self._clock() + self.hold_off_s
            now = self._clock()
            waits = [next_full - now] if self.interval_s > 0 else []
            waits += [self._held_off[name] - now for name in self._soon if name in self._held_off]
            wait = max(0.0, min(waits)) if waits else None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._wake.wait()

    async def tend(self, tenant_name: str, delete: Callable[[Tenant, str], Awaitable[object]]) -> None:
        """Expire the tenant's idle sessions, then collect its pieces (logged, never raised)."""
        tenant = self.tenants.by_name.get(tenant_name)
        if tenant is not None and tenant.idle_ttl_s is not None:
            await self._quietly(tenant_name, self.expire(tenant, delete))
        await self._quietly(tenant_name, self.store.collect(tenant_name))

    async def _quietly(self, tenant: str, work: Awaitable[object]) -> bool:
        """Run ``work``; False when it was skipped (another collector, or saves held on)."""
        try:
            await work
        except LockBusy as exc:
            log.info("retention.skipped", tenant=tenant, reason=str(exc))
            return False
        except (StorageError, ApiError) as exc:
            log.warning("retention.failed", tenant=tenant, error=str(exc))
        return True

    async def expire(self, tenant: Tenant, delete: Callable[[Tenant, str], Awaitable[object]]) -> int:
        """Delete the sessions unused for longer than the tenant's idle TTL; returns how many."""
        assert tenant.idle_ttl_s is not None
        expired = 0
        for session in await self.index.unused_since(tenant.name, self._clock() - tenant.idle_ttl_s):
            try:
                await delete(tenant, session)
                expired += 1
                log.info("retention.expired", tenant=tenant.name, session=session, ttl_s=tenant.idle_ttl_s)
            except (NotStored, ApiError, StorageError) as exc:  # busy now (in use again), or gone
                log.info("retention.expire_skipped", tenant=tenant.name, session=session, error=str(exc))
        return expired

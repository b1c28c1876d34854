"""The gateway's view of the pool: which engines serve which model, and who sits in their slots.

Engines come from the registry (alive within their heartbeat TTL), cached here: the listing is read
again when the registry's epoch moves (every registration, unregistration and noticed expiry bumps
it; each turn's opening read returns it, `saw_epoch`) or when a cached engine's TTL runs out (a
heartbeat extended it, or its node died silently). So a warm turn reads no registry. Slot occupancy
comes from the session index (live records carry engine and slot); busy = the session's lock is
held. The node that owns an engine is found among the configured node agents by the node id they
report.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import httpx

from gateway.placement import EngineView, SlotView
from storage.engines import EngineInfo, EngineRegistry
from storage.index import SessionIndex, SessionState
from storage.locks import SessionLocks

_CONFIGURED_TTL_S = 5.0


@dataclass(frozen=True)
class EngineRef:
    engine: str
    node: str
    url: str
    model: str
    n_slots: int


class Cluster:
    def __init__(
        self,
        registry: EngineRegistry,
        index: SessionIndex,
        locks: SessionLocks,
        node_urls: tuple[str, ...],
        http: httpx.AsyncClient,
        *,
        sample: int = 16,
        rng: random.Random | None = None,
    ) -> None:
        self.registry = registry
        self.index = index
        self.locks = locks
        self._node_urls = node_urls
        self.sample = sample  # engines a placement snapshot looks at, at most (plus the tenant's own)
        self._random = rng or random.Random()
        self._http = http
        self._nodes: dict[str, str] = {}  # node id -> agent URL
        self._configured: set[str] = set()
        self._configured_at = -_CONFIGURED_TTL_S
        self._listing: list[EngineInfo] | None = None  # the cached registry (None: read it)
        self._epoch = -1
        self._refreshing: asyncio.Future[None] | None = None

    def saw_epoch(self, epoch: int) -> None:
        """The registry's epoch as a turn's opening read found it: a new one drops the cache."""
        if epoch != self._epoch:
            self._listing = None

    async def _registry(self, fresh: bool) -> list[EngineInfo]:
        now = self.registry.now()
        listing = self._listing
        if fresh or listing is None or any(i.expires <= now for i in listing):
            listing = await self._read_registry()
        return [i for i in listing if i.expires > now]

    async def _read_registry(self) -> list[EngineInfo]:
        """One read at a time: concurrent turns that find the cache stale share it."""
        if self._refreshing is None:
            self._refreshing = asyncio.ensure_future(self._fetch_registry())
        refreshing = self._refreshing
        try:
            await asyncio.shield(refreshing)
        finally:
            if self._refreshing is refreshing and refreshing.done():
                self._refreshing = None
        assert self._listing is not None
        return self._listing

    async def _fetch_registry(self) -> None:
        self._epoch, self._listing = await self.registry.listing()

    async def engines(self, model: str | None = None, *, fresh: bool = False) -> list[EngineRef]:
        """Engines alive (serving `model`), from the cache unless `fresh`."""
        infos = await self._registry(fresh)
        return [
            EngineRef(i.engine_id, i.node, i.url, i.model, i.n_slots)
            for i in infos
            if model is None or i.model == model
        ]

    async def models(self, *, fresh: bool = False) -> set[str]:
        return {e.model for e in await self.engines(fresh=fresh)}

    async def configured_models(self) -> set[str] | None:
        """The models the node agents run engines for, ready or not: tells a model that is restarting
        (503) from one that does not exist (404). None when a node did not answer (nobody can tell).
        A complete answer is kept a few seconds; an incomplete one is asked again next time."""
        if time.monotonic() - self._configured_at <= _CONFIGURED_TTL_S:
            return self._configured

        async def listed(url: str) -> set[str] | None:
            try:
                resp = await self._http.get(url.rstrip("/") + "/v1/engines", timeout=5.0)
                return {str(e["model"]) for e in resp.json()["engines"]}
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                return None

        found = await asyncio.gather(*(listed(u) for u in self._node_urls))
        models: set[str] = set()
        for listing in found:
            if listing is None:
                return None
            models |= listing
        self._configured, self._configured_at = models, time.monotonic()
        return self._configured

    async def engine(self, engine_id: str) -> EngineRef | None:
        for e in await self.engines():
            if e.engine == engine_id:
                return e
        return None

    async def snapshot(
        self, model: str, holder: tuple[str, str] | None = None, *, with_tenant_engines: bool = False
    ) -> tuple[list[EngineView], dict[str, EngineRef]]:
        """Engines serving `model` and who sits in their slots, in two round trips whatever the
        pool's and the index's size: above `sample` engines, a random sample of them (the best
        free slot or LRU victim among those: power-of-d choices), plus, `with_tenant_engines`, every
        engine holding one of the holder tenant's live sessions (its live-slot quota counts them).
        `holder` is the session whose lock the caller holds: its own slot is not busy for it. Also
        returns those engines by id (their URLs and nodes)."""
        refs = {e.engine: e for e in await self.engines(model)}
        if len(refs) > self.sample:
            picked = set(self._random.sample(sorted(refs), self.sample))
            if with_tenant_engines and holder is not None:
                picked |= await self.index.tenant_live_engines(holder[0]) & refs.keys()
            refs = {e: refs[e] for e in sorted(picked)}
        live, idle = await self.index.engines_occupancy(list(refs))
        pairs = [pair for sessions in live.values() for pair in sessions]
        occupants: dict[str, dict[int, SlotView]] = {e: {} for e in refs}
        for (tenant, session), (rec, owner) in zip(pairs, await self.index.occupants(pairs), strict=True):
            if (
                rec is None
                or rec.state is not SessionState.LIVE
                or rec.slot is None
                or rec.engine not in refs
            ):
                continue
            # Locked but idle: its last turn is being saved (write-behind), which ends shortly; it
            # can be evicted once the save releases the lock. Busy means a request runs on it.
            busy = owner is not None and (tenant, session) not in idle and (tenant, session) != holder
            occupants[rec.engine][rec.slot] = SlotView(rec.slot, busy, tenant, session, rec.last_used)
        views = [
            EngineView(
                e.engine,
                e.model,
                True,
                tuple(occupants[e.engine].get(i, SlotView(i)) for i in range(e.n_slots)),
            )
            for e in refs.values()
        ]
        return views, refs

    async def node_url(self, node_id: str) -> str | None:
        if node_id not in self._nodes:
            await self.refresh_nodes()
        return self._nodes.get(node_id)

    async def node_ids(self) -> list[str]:
        """The ids of the node agents that answered the last refresh."""
        return sorted(self._nodes)

    async def refresh_nodes(self) -> None:
        async def probe(url: str) -> tuple[str, str] | None:
            try:
                resp = await self._http.get(url.rstrip("/") + "/health", timeout=5.0)
                node = resp.json().get("node")
            except (httpx.HTTPError, ValueError, AttributeError):
                return None
            return (node, url.rstrip("/")) if isinstance(node, str) else None

        for found in await asyncio.gather(*(probe(u) for u in self._node_urls)):
            if found:
                self._nodes[found[0]] = found[1]

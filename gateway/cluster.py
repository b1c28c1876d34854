"""The gateway's view of the pool: which engines serve which model, and who sits in their slots.

Engines come from the registry (alive within their heartbeat TTL); slot occupancy from the session
index (live records carry engine and slot); busy = the session's lock is held. The node that owns
an engine is found among the configured node agents by the node id they report.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

from gateway.placement import EngineView, SlotView
from storage.engines import EngineInfo, EngineRegistry
from storage.index import SessionIndex, SessionState
from storage.locks import SessionLocks


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
    ) -> None:
        self.registry = registry
        self.index = index
        self.locks = locks
        self._node_urls = node_urls
        self._http = http
        self._nodes: dict[str, str] = {}  # node id -> agent URL

    async def engines(self, model: str | None = None) -> list[EngineRef]:
        infos: list[EngineInfo] = await self.registry.list(model)
        return [EngineRef(i.engine_id, i.node, i.url, i.model, i.n_slots) for i in infos]

    async def models(self) -> set[str]:
        return {e.model for e in await self.engines()}

    async def engine(self, engine_id: str) -> EngineRef | None:
        for e in await self.engines():
            if e.engine == engine_id:
                return e
        return None

    async def snapshot(self, model: str, holder: tuple[str, str] | None = None) -> list[EngineView]:
        """Engines serving `model` and their slots. `holder` is the session whose lock the caller
        holds: its own slot is not busy for it."""
        views = []
        for e in await self.engines(model):
            occupants: dict[int, SlotView] = {}
            for tenant, session in await self.index.engine_sessions(e.engine):
                rec = await self.index.find(tenant, session)
                if (
                    rec is None
                    or rec.state is not SessionState.LIVE
                    or rec.slot is None
                    or rec.engine != e.engine
                ):
                    continue
                busy = (tenant, session) != holder and await self.locks.owner(tenant, session) is not None
                occupants[rec.slot] = SlotView(rec.slot, busy, tenant, session, rec.last_used)
            slots = tuple(occupants.get(i, SlotView(i)) for i in range(e.n_slots))
            views.append(EngineView(e.engine, e.model, True, slots))
        return views

    async def node_url(self, node_id: str) -> str | None:
        if node_id not in self._nodes:
            await self.refresh_nodes()
        return self._nodes.get(node_id)

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

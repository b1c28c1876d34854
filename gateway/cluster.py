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
from dataclasses import dataclass, replace

import httpx

from engine_pool.protocol.handoff import holds_sessions
from engine_pool.protocol.node import UNSTORED, EngineList, NodeEngine, UnstoredCopy, UnstoredList
from storage.index.engines import EngineInfo, EngineRegistry
from storage.index.session_index import SessionIndex


@dataclass(frozen=True)
class SlotView:
    slot: int
    busy: bool = False
    tenant: str | None = None  # the session held by the slot, if any
    session: str | None = None
    last_used: float = 0.0
    saving: bool = False  # idle, its lock held by the write-behind save of its last turn


@dataclass(frozen=True)
class EngineView:
    engine: str
    model: str
    ready: bool
    slots: tuple[SlotView, ...]


_CONFIGURED_TTL_S = 5.0


@dataclass(frozen=True)
class EngineRef:
    engine: str
    node: str
    url: str
    model: str
    n_slots: int
    instance: str = ""  # its process's instance id as registered ('' unknown)
    role: str = "mixed"  # prefill | decode | mixed (engine_pool.protocol.handoff)


@dataclass(frozen=True)
class _Listing:
    """The registry as read once: engines by id and by model, good until the first one's TTL ends
    (a heartbeat has extended it by then: read again)."""

    refs: dict[str, EngineRef]
    by_model: dict[str, list[EngineRef]]  # the engines turns are placed on (not prefill engines)
    valid_until: float
    prefill: dict[str, list[EngineRef]]  # by model: the prefill engines

    @classmethod
    def of(cls, infos: list[EngineInfo]) -> _Listing:
        refs = {
            i.engine_id: EngineRef(i.engine_id, i.node, i.url, i.model, i.n_slots, i.instance, i.role)
            for i in infos
        }
        by_model: dict[str, list[EngineRef]] = {}
        prefill: dict[str, list[EngineRef]] = {}
        for ref in refs.values():
            (by_model if holds_sessions(ref.role) else prefill).setdefault(ref.model, []).append(ref)
        return cls(refs, by_model, min((i.expires for i in infos), default=float("inf")), prefill)


@dataclass(frozen=True)
class LabelledSlot:
    """A slot whose engine says it holds a session's state (the label the gateway gave it)."""

    engine: str
    slot: int
    tenant: str
    session: str
    tokens: int
    model: str = ""


def failed_models(engines: list[NodeEngine]) -> dict[str, str]:
    """Model → why, for each model every listed engine of which is ``failed`` (given up by its
    supervisor; one engine of the model still running or retrying keeps it off the list)."""
    out: dict[str, str] = {}
    running: set[str] = set()
    for e in engines:
        if e.state == "failed":
            out.setdefault(e.model, (e.error or e.last_error).split("\n", 1)[0])
        else:
            running.add(e.model)
    return {m: why for m, why in out.items() if m not in running}


def not_ready_reason(engines: list[NodeEngine], complete: bool, n_nodes: int) -> str:
    """Why no engine serves, in one line, from the node agents' engine lists (`complete`: every
    node answered): engines that gave up say their own reason, starting ones their state."""
    if not engines:
        if not complete:
            return f"no node agent answered (of {n_nodes} configured): are they running?"
        return "the node agents run no engine"
    parts = []
    for e in engines:
        name, state = e.id or e.model, e.state or "unknown"
        why = (e.error or e.last_error).split("\n", 1)[0]
        said = {"failed": f"{name} gave up: {why}", "crashed": f"{name} crashed ({why}), restarting"}
        parts.append(said.get(state, f"{name} is {state}"))
    if not complete:
        parts.append("a node agent did not answer")
    return "; ".join(parts)


class Cluster:
    def __init__(
        self,
        registry: EngineRegistry,
        index: SessionIndex,
        node_urls: tuple[str, ...],
        http: httpx.AsyncClient,
        *,
        sample: int = 8,
        rng: random.Random | None = None,
    ) -> None:
        self.registry = registry
        self.index = index
        self._node_urls = node_urls
        self.sample = sample  # engines a pool view looks at, at most (plus the tenant's own)
        self._random = rng or random.Random()
        self._http = http
        self._nodes: dict[str, str] = {}  # node id -> agent URL
        self._configured: list[NodeEngine] = []  # the nodes' engines as /v1/engines lists them
        self._configured_at = -_CONFIGURED_TTL_S
        self._cache: _Listing | None = None  # the cached registry (None: read it)
        self._epoch = -1
        self._refreshing: asyncio.Future[None] | None = None

    def saw_epoch(self, epoch: int) -> None:
        """The registry's epoch as a turn's opening read found it: a new one drops the cache."""
        if epoch != self._epoch:
            self._cache = None

    async def _listing(self, fresh: bool) -> _Listing:
        cache = self._cache
        if fresh or cache is None or self.registry.now() >= cache.valid_until:
            cache = await self._read_registry()
        return cache

    async def _read_registry(self) -> _Listing:
        """One read at a time: concurrent turns that find the cache stale share it."""
        if self._refreshing is None:
            self._refreshing = asyncio.ensure_future(self._fetch_registry())
        refreshing = self._refreshing
        try:
            await asyncio.shield(refreshing)
        finally:
            if self._refreshing is refreshing and refreshing.done():
                self._refreshing = None
        assert self._cache is not None
        return self._cache

    async def _fetch_registry(self) -> None:
        epoch, infos = await self.registry.listing()
        self._epoch, self._cache = epoch, _Listing.of(infos)

    async def engines(self, model: str | None = None, *, fresh: bool = False) -> list[EngineRef]:
        """Engines alive (those that turns are placed on serving `model`), from the cache unless
        `fresh`, by id."""
        cache = await self._listing(fresh)
        return list(cache.refs.values()) if model is None else cache.by_model.get(model, [])

    async def prefill_engines(self, model: str) -> list[EngineRef]:
        """The prefill engines alive serving `model` (engine_pool.protocol.handoff), by id."""
        return (await self._listing(False)).prefill.get(model, [])

    async def models(self, *, fresh: bool = False) -> set[str]:
        return {e.model for e in await self.engines(fresh=fresh)}

    async def configured_models(self) -> set[str] | None:
        """The models the node agents run engines for, ready or not: tells a model that is restarting
        (503) from one that does not exist (404). None when a node did not answer (nobody can tell)."""
        engines, complete = await self._node_engines()
        return {e.model for e in engines} if complete else None

    async def failed_models(self) -> dict[str, str]:
        """Models whose every engine on the nodes that answered was given up (state ``failed``: it
        failed to start the same way several times), with why, in one line."""
        engines, _ = await self._node_engines()
        return failed_models(engines)

    async def not_ready_reason(self) -> str:
        """Why no engine is registered, asked of the node agents afresh (`not_ready_reason`)."""
        engines, complete = await self._node_engines(fresh=True)
        return not_ready_reason(engines, complete, len(self._node_urls))

    async def _node_engines(self, fresh: bool = False) -> tuple[list[NodeEngine], bool]:
        """Every engine the node agents run, ready or not, as their /v1/engines lists it, and whether
        every node answered (a listing that is not an `EngineList` counts as no answer). A complete
        answer is kept a few seconds (``fresh``: ask anyway); an incomplete one is asked again next
        time."""
        if not fresh and time.monotonic() - self._configured_at <= _CONFIGURED_TTL_S:
            return self._configured, True

        async def listed(url: str) -> tuple[NodeEngine, ...] | None:
            try:
                resp = await self._http.get(url.rstrip("/") + "/v1/engines", timeout=5.0)
                return EngineList.from_json(resp.json()).engines
            except (httpx.HTTPError, ValueError):  # (the codec's WireError is a ValueError)
                return None

        found = await asyncio.gather(*(listed(u) for u in self._node_urls))
        engines = [e for listing in found if listing is not None for e in listing]
        if any(listing is None for listing in found):
            return engines, False
        self._configured, self._configured_at = engines, time.monotonic()
        return engines, True

    async def labelled_slots(self) -> list[LabelledSlot]:
        """The slots the ready engines say whose session they hold (their labels, as the gateway
        set them: GET /slots), asked of every engine the node agents run; an engine that does not
        answer is left out. What a lost index is rebuilt from, beside the store: asked afresh (a
        listing kept from before may show an engine still starting)."""
        engines, _ = await self._node_engines(fresh=True)

        async def labelled(engine: NodeEngine) -> list[LabelledSlot]:
            try:
                resp = await self._http.get(str(engine.url).rstrip("/") + "/slots", timeout=5.0)
                return [
                    LabelledSlot(engine.id, int(s["id"]), s["owner"], s["session"], int(s["n_tokens"]))
                    for s in resp.json()
                    if isinstance(s.get("session"), str)
                    and isinstance(s.get("owner"), str)
                    and s["n_tokens"] > 0
                ]
            except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
                return []

        ready = [e for e in engines if e.state == "ready" and e.url]
        found = await asyncio.gather(*(labelled(e) for e in ready))
        models = {e.id: e.model for e in ready}
        return [replace(s, model=models[s.engine]) for listing in found for s in listing]

    async def unstored_copies(
        self, tenant: str | None = None, session: str | None = None
    ) -> list[UnstoredCopy]:
        """The generations only a node's spill cache holds (saved while the store was away, not
        flushed yet) — of one session when ``tenant`` and ``session`` are given — asked of every
        configured node agent; one that does not answer is left out. What a lost index is rebuilt
        from beside the store and the slots."""
        params = {"tenant": tenant, "session": session} if session is not None else None

        async def listed(url: str) -> tuple[UnstoredCopy, ...]:
            try:
                resp = await self._http.get(url.rstrip("/") + UNSTORED, params=params, timeout=5.0)
                resp.raise_for_status()
                return UnstoredList.from_json(resp.json()).copies
            except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
                return ()

        found = await asyncio.gather(*(listed(u) for u in self._node_urls))
        return [c for copies in found for c in copies]

    async def engine(self, engine_id: str) -> EngineRef | None:
        return (await self._listing(False)).refs.get(engine_id)

    def cached_engine(self, engine_id: str) -> EngineRef | None:
        """The engine as the cached listing has it, without reading anything (None: not cached, or
        the cache is stale)."""
        cache = self._cache
        if cache is None or self.registry.now() >= cache.valid_until:
            return None
        return cache.refs.get(engine_id)

    def cached_prefill_engines(self, model: str) -> list[EngineRef]:
        """The prefill engines of `model` as the cached listing has them, without reading anything
        ([] when not cached, or the cache is stale)."""
        cache = self._cache
        if cache is None or self.registry.now() >= cache.valid_until:
            return []
        return cache.prefill.get(model, [])

    async def pool_view(
        self,
        model: str,
        holder: tuple[str, str] | None = None,
        *,
        live_limit: int | None = None,
        also: str | None = None,
    ) -> tuple[list[EngineView], dict[str, EngineRef]]:
        """Engines serving `model` and who sits in their slots, in one round trip whatever the
        pool's and the index's size: above `sample` engines, a random sample of them (the best
        free slot or LRU victim among those: power-of-d choices), plus `also` (an engine the caller
        would prefer) and, when the holder's tenant holds its live-slot quota (`live_limit`)
        already, every engine holding one of its other live sessions: it makes room among them
        (gateway.turn.slot_choice). `holder` is the session whose lock the caller holds: its own
        slot is not busy for it. Also returns those engines by id (their URLs and nodes)."""
        serving = await self.engines(model)
        if len(serving) > self.sample:
            picked = set(self._random.sample(range(len(serving)), self.sample))
            picked |= {i for i, e in enumerate(serving) if e.engine == also}
            if live_limit is not None and holder is not None:
                live = await self.index.tenant_live_sessions(holder[0])
                others = {s: e for s, e in live.items() if s != holder[1]}
                if len(others) >= live_limit:
                    own = set(others.values())
                    picked |= {i for i, e in enumerate(serving) if e.engine in own}
            serving = [serving[i] for i in sorted(picked)]
        refs = {e.engine: e for e in serving}
        occupants: dict[str, dict[int, SlotView]] = {e: {} for e in refs}
        unread: set[str] = set()  # (Redis Cluster) engines whose occupancy a shard away hides
        found = await self.index.slot_occupants(list(refs), unread)
        refs = {e: ref for e, ref in refs.items() if e not in unread}
        for engine, (tenant, session), rec, idle in found:
            if rec is None or not rec.live or rec.slot is None or rec.engine != engine:
                continue
            # Locked but idle: its last turn is being saved (write-behind), which ends shortly; it
            # can be evicted once the save releases the lock. Busy means a request runs on it.
            busy = rec.owner is not None and not idle and (tenant, session) != holder
            saving = rec.owner is not None and idle
            occupants[engine][rec.slot] = SlotView(rec.slot, busy, tenant, session, rec.last_used, saving)
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

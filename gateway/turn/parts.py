"""What every step of a turn works with, built once per process (gateway.main) and handed down.

The clients (index, locks, store, cluster, engines, node agents) and the two pieces of this
process's own state that the steps share, each with its one owner: the session locks held here
(`Holds`) and the slots chosen here but not yet recorded (`SlotReservations`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine_pool.errors import Unavailable
from engine_pool.pool.client import NodeClient
from gateway.cluster import Cluster
from gateway.engine_http import EngineHttp
from gateway.healing import IndexHealing
from gateway.metrics import Metrics
from gateway.tenants import StoreOutage, Tenant, Tenants
from gateway.turn.hold import Holds, SessionHold
from gateway.turn.prompt import Prompt
from gateway.turn.reservations import SlotReservations
from gateway.turn.slot_choice import Placement
from storage.blobs.blobstore import BlobStore
from storage.index.locks import SessionLock, SessionLocks
from storage.index.session_index import SessionIndex


@dataclass(frozen=True)
class TurnSettings:
    """What the steps of a turn read of the gateway's settings (gateway.settings), built once."""

    lock_ttl_s: float
    spill_wait_s: float  # the longest a turn waits for a lock held by a save, a delete, an eviction
    save_grace_s: float = 0.0
    early_start: bool = True  # launch a held session's turn beside its opening read (gateway.turn.early)
    internal_key: str | None = None  # what the node agents require
    keep_generations: int = 2  # stored generations a session keeps (the newest)
    max_inflight: int = 64  # a tenant's in-flight places unless its quota says
    inflight_ttl_s: float = 660.0  # a place lapses after this (its gateway died)
    handoff: str = "logits"  # the prefill/decode split (gateway.turn.handoff): what is handed over,
    handoff_threshold: int | None = 2048  # from how long an uncached tail for tenants that set none
    handoff_wait_s: float = 2.0  # (None: never), how long a turn waits for a prefill slot, and how
    handoff_timeout_s: float = 300.0  # long its prefill may take there


@dataclass
class Turn:
    """A placed turn: what answering it and finishing it need (gateway.turn.serving, gateway.turn.close)."""

    tenant: Tenant
    session: str
    model: str
    hold: SessionHold  # the session's lock, shared with this turn's write-behind save
    placement: Placement
    engine_url: str
    node: NodeClient
    source: str  # how the session was found (gateway.turn.signals), or implicit | new | fork
    forked_from: str | None = None
    inflight: str = ""  # the tenant's in-flight place this turn holds (given back when it finishes)
    early: bool = False  # the call launched before its opening read is this turn's (confirmed)
    shared: str | None = None  # its shared prefix's digest, to record for other sessions (or None)
    prompt: Prompt | None = None  # what it was placed for (its tools name its prompt's digest)
    created: bool = False  # its session's record was created for it (a new session, a branch, a fork)

    @property
    def lock(self) -> SessionLock:
        return self.hold.lock


@dataclass
class TurnParts:
    cluster: Cluster
    index: SessionIndex
    locks: SessionLocks
    store: BlobStore
    metrics: Metrics
    settings: TurnSettings
    engines: EngineHttp | None = None  # engine requests (asking an engine for a prompt's tokens)
    tenants: Tenants | None = None
    superseded: Callable[[str], None] | None = None  # told the tenant whose stored generations went
    healing: IndexHealing | None = None  # a lost index noticed and rebuilt (gateway.healing)
    nodes: dict[str, NodeClient] = field(default_factory=dict)  # node id -> client (made on first use)
    holds: Holds = field(init=False)  # the session locks this process holds
    reserved: SlotReservations = field(default_factory=SlotReservations)  # chosen, not yet recorded

    def __post_init__(self) -> None:
        self.holds = Holds(self.locks, self.settings.lock_ttl_s, self.settings.save_grace_s)

    async def node(self, node_id: str) -> NodeClient:
        if node_id not in self.nodes:
            url = await self.cluster.node_url(node_id)
            if url is None:
                raise Unavailable(f"node {node_id} is not reachable", retry_after=2)
            self.nodes[node_id] = NodeClient(url, key=self.settings.internal_key)
        return self.nodes[node_id]

    async def all_nodes(self) -> list[NodeClient]:
        await self.cluster.refresh_nodes()
        return [await self.node(node_id) for node_id in await self.cluster.node_ids()]

    def shares(self, tenant: str) -> bool:
        """Whether the tenant's sessions share stored chunks (a tenants-file setting, default yes)."""
        known = self.tenants.by_name.get(tenant) if self.tenants is not None else None
        return known.share_chunks if known is not None else True

    def reprefills(self, tenant: str) -> bool:
        """Whether the tenant's turns re-prefill rather than wait while the store is down (its
        `on_store_outage`; default: wait, 503 + Retry-After)."""
        known = self.tenants.by_name.get(tenant) if self.tenants is not None else None
        return known is not None and known.store_outage is StoreOutage.REPREFILL

    def told_superseded(self, tenant: str) -> None:
        if self.superseded is not None:
            self.superseded(tenant)

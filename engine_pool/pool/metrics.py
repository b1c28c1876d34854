"""The node agent's Prometheus metrics: slot moves (spill/fill/erase) with their bytes and seconds,
handoffs (prefill/decode split) by result with their bytes and seconds, prefills run for other
nodes' handoffs by result, engines by state and role
and their restarts, the spill cache (bytes held, uploads pending), and restores waiting for their
bytes in flight."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..protocol.handoff import ROLES, HandoffOutcome, HandoffResult
from ..protocol.node import FillResult, SlotResult, SpillResult
from .restore_gate import RestoreGate
from .supervisor import EngineSnapshot, State


class NodeMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.operations = Counter(
            "slotkeeper_node_slot_operations",
            "Spill/fill/erase calls by outcome",
            ["op", "outcome"],
            registry=r,
        )
        self.bytes = Counter(
            "slotkeeper_node_slot_bytes", "Slot-file bytes moved", ["op", "source"], registry=r
        )
        self.seconds = Histogram("slotkeeper_node_slot_seconds", "Spill/fill duration", ["op"], registry=r)
        self.engines = Gauge("slotkeeper_node_engines", "Engines by state", ["state"], registry=r)
        self.roles = Gauge("slotkeeper_node_engine_roles", "Engines by role", ["role"], registry=r)
        self.handoffs = Counter(
            "slotkeeper_node_handoffs", "Prefill/decode handoffs by result", ["result"], registry=r
        )
        self.peer_prefills = Counter(
            "slotkeeper_node_peer_prefills",
            "Prefills run on this node's prefill engines for other nodes' handoffs, by result",
            ["result"],
            registry=r,
        )
        self.handoff_bytes = Counter(
            "slotkeeper_node_handoff_bytes", "State bytes handed from prefill to decode engines", registry=r
        )
        self.handoff_seconds = Histogram(
            "slotkeeper_node_handoff_seconds",
            "Handoff duration (prefill, export, install)",
            ["result"],
            registry=r,
        )
        self.restarts = Gauge(
            "slotkeeper_node_engine_restarts", "Restarts per engine", ["engine"], registry=r
        )
        self.cache_bytes = Gauge("slotkeeper_node_spill_cache_bytes", "Bytes in the spill cache", registry=r)
        self.pending = Gauge("slotkeeper_node_uploads_pending", "Spilled files not yet uploaded", registry=r)
        self.pending_bytes = Gauge(
            "slotkeeper_node_uploads_pending_bytes", "Bytes of spilled files not yet uploaded", registry=r
        )
        self.restore_bytes = Gauge(
            "slotkeeper_node_restore_bytes_in_flight", "Slot-file bytes restores hold now", registry=r
        )
        self.restores_waiting = Gauge(
            "slotkeeper_node_restores_waiting", "Restores waiting for their bytes in flight", registry=r
        )
        self.restores_waited = Counter(
            "slotkeeper_node_restores_waited", "Restores that waited for their bytes in flight", registry=r
        )

    def observe(self, op: str, seconds: float, result: SlotResult | None) -> None:
        """One finished operation (`result` None when it failed)."""
        self.operations.labels(op, "ok" if result is not None else "error").inc()
        if result is None or op == "erase":
            return
        self.seconds.labels(op).observe(seconds)
        source = result.source if isinstance(result, FillResult) else "engine" if op == "spill" else "store"
        nbytes = result.bytes if isinstance(result, SpillResult | FillResult) else 0
        self.bytes.labels(op, source).inc(nbytes)

    def handoff_done(self, result: HandoffResult) -> None:
        self.handoffs.labels(HandoffOutcome.DONE.value).inc()
        self.handoff_bytes.inc(result.bytes)
        self.handoff_seconds.labels(HandoffOutcome.DONE.value).observe(result.ms / 1000)

    def handoff_failed(self, outcome: HandoffOutcome, seconds: float) -> None:
        self.handoffs.labels(outcome.value).inc()
        self.handoff_seconds.labels(outcome.value).observe(seconds)

    def render(
        self,
        snaps: Iterable[EngineSnapshot],
        cache_bytes: int,
        pending: int,
        pending_bytes: int,
        restores: RestoreGate,
    ) -> bytes:
        counts = dict.fromkeys((s.value for s in State), 0)
        roles = dict.fromkeys(ROLES, 0)
        for snap in snaps:
            counts[snap.state.value] += 1
            roles[snap.role] = roles.get(snap.role, 0) + 1
            self.restarts.labels(snap.engine_id).set(snap.restarts)
        for state, n in counts.items():
            self.engines.labels(state).set(n)
        for role, n in roles.items():
            self.roles.labels(role).set(n)
        self.cache_bytes.set(cache_bytes)
        self.pending.set(pending)
        self.pending_bytes.set(pending_bytes)
        self.restore_bytes.set(restores.in_flight)
        self.restores_waiting.set(restores.waiting)
        return generate_latest(self.registry)

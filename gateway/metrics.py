"""The gateway's Prometheus metrics, in one registry per process (served on /metrics)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine_pool.http.middleware import HttpMiddleware
from engine_pool.process.metric_families import Families
from engine_pool.protocol.metric_labels import route_label

# Routes that are not load: probes and scrapes stay out of `requests_in_flight`, which the chart's
# HPA can scale on (a scrape counting itself would never read 0). They are still counted by status.
NOT_LOAD = frozenset({"/health", "/ready", "/metrics"})


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        family = Families(self.registry, "slotkeeper_gateway_")
        self.requests = family(Counter, "requests", "Requests by path and status", "path", "status")
        self.served = family(Counter, "sessions_served", "Turns by how the session was served", "cache")
        self.prompt_tokens = family(Counter, "prompt_tokens", "Prompt tokens evaluated vs reused", "kind")
        self.tenant_prompt_tokens = family(
            Counter,
            "tenant_prompt_tokens",
            "Prompt tokens evaluated vs reused, by tenant and how the session was served (live, restored, "
            "prefix: from a slot of the tenant sharing its prefix, stored-prefix, cold)",
            "tenant",
            "kind",
            "served",
        )
        self.volatile_blocks = family(
            Counter,
            "volatile_blocks",
            "Requests a volatile-block rule changed before rendering, by rule",
            "rule",
        )
        self.hosted_tools_omitted = family(
            Counter,
            "hosted_tools_omitted",
            "Hosted tools (web_search, file_search, mcp, ...) left out of Responses prompts, by type "
            "(the tenant's hosted_tools = omit)",
            "type",
        )
        self.restores_reprefilled = family(
            Counter,
            "restores_reprefilled",
            "Restored turns that still re-evaluated the whole prompt (alert on this)",
        )
        self.restore_failures = family(
            Counter, "restore_failures", "Fills refused (damaged/foreign file): served cold"
        )
        self.handoffs = family(
            Counter,
            "handoffs",
            "Turns prefilled on a prefill engine for a decode engine, by result (done; refused: the "
            "decode engine refused the state; unavailable: no prefill slot in time; failed): any "
            "but done ran unsplit",
            "result",
        )
        self.handoff_bytes = family(Counter, "handoff_bytes", "State bytes handed to decode engines")
        self.handoff_seconds = family(
            Histogram,
            "handoff_seconds",
            "Handoffs' duration: prefill, export and install",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.store_outage_reprefills = family(
            Counter,
            "store_outage_reprefills",
            "Turns of stored sessions served from the whole prompt while the store was down (the "
            "tenant's on_store_outage = reprefill)",
        )
        self.evictions = family(Counter, "evictions", "Idle sessions spilled for room")
        self.branches = family(
            Counter,
            "branches",
            "Turns that did not continue the state of the session they reached and started a branch "
            "of it instead (gateway.turn.branch), by how the session was found",
            "source",
        )
        self.branches_refused = family(
            Counter,
            "branches_refused",
            "Turns that would have branched but ran on the session they reached (rolling it back): "
            "the tenant's quotas left no room for a new session",
        )
        self.slot_changed = family(
            Counter,
            "slot_changed",
            "Sessions the index placed in a slot that held another's state (an engine restarted, a "
            "stale record): placed again from their stored state",
        )
        self.index_rebuilds = family(Counter, "index_rebuilds", "Lost indexes rebuilt here from the store")
        self.index_recovered = family(Counter, "index_recovered", "Sessions found in the store while healing")
        self.index_live_adopted = family(Counter, "index_live_adopted", "Sessions found live by healing")
        self.spill_bytes = family(Counter, "spill_bytes", "Bytes of slot files saved", "why")
        self.store_written = family(
            Counter,
            "store_written_bytes",
            "Bytes saves added to the store (only chunks it lacked, the tail and the manifest)",
            "why",
        )
        self.spill_seconds = family(Histogram, "spill_seconds", "Save + upload time of a slot", "why")
        self.saves_skipped = family(
            Counter, "saves_skipped", "After-turn saves not made, by reason", "reason"
        )
        self.early_starts = family(
            Counter,
            "early_starts",
            "Warm turns sent to their slot before the opening read, by outcome: answered (the read "
            "confirmed it), abandoned (not confirmed: sent again as usual, or refused), refused (the "
            "engine had restarted: sent again as usual)",
            "outcome",
        )
        self.ttft = family(Histogram, "ttft_seconds", "Time to the engine's first byte")
        self.in_flight = family(
            Gauge,
            "requests_in_flight",
            "Requests being answered now, streams until their last byte or the client's disconnect"
            " (probes and scrapes excluded)",
        )

    def turn_served(self, tenant: str, cache: str, timings: Mapping[str, Any]) -> None:
        """One turn's prompt tokens, from the engine's `timings` (llama-server's numbers); `cache`
        is how the session was served (`X-Slotkeeper-Cache`: a restore that reused nothing is
        counted). Tenants come from the tenants file: the label's values are bounded."""
        prompt_n, cache_n = int(timings.get("prompt_n", 0)), int(timings.get("cache_n", 0))
        self.prompt_tokens.labels("evaluated").inc(prompt_n)
        self.prompt_tokens.labels("reused").inc(cache_n)
        self.tenant_prompt_tokens.labels(tenant, "evaluated", cache).inc(prompt_n)
        self.tenant_prompt_tokens.labels(tenant, "reused", cache).inc(cache_n)
        if cache == "restored" and timings and cache_n == 0:
            self.restores_reprefilled.inc()

    def spilled(self, why: str, nbytes: int, ms: float, written: int = 0) -> None:
        self.spill_bytes.labels(why).inc(nbytes)
        self.store_written.labels(why).inc(written)
        self.spill_seconds.labels(why).observe(ms / 1000)


class RequestCounter(HttpMiddleware):
    """ASGI middleware: one count per response, by route template and status (streams included),
    and the requests in flight: from the request's arrival until the app returns — for a stream,
    after its last chunk or the client's disconnect; for a request that raised, when the exception
    passes here on its way to the server's error handler. Paths no route matches share one label,
    `other`: a client cannot mint series."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: Sequence[Any]) -> None:
        super().__init__(app)
        self.metrics = metrics
        self.routes = routes

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = route_label(scope["path"], self.routes)

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        if path in NOT_LOAD:
            await self.app(scope, receive, counted)
            return
        with self.metrics.in_flight.track_inprogress():  # decrements in a `finally`
            await self.app(scope, receive, counted)

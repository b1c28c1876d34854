"""Prometheus metrics of one engine process: its own request metrics and the core's counters.

The registry belongs to the process's Runtime (no module globals, so tests can run several apps).
It also holds prometheus_client's process collector (`process_start_time_seconds`, CPU seconds,
resident memory, open files: what a restart or a leak shows in), read from /proc at scrape time.
The core's counters (`engine.metrics()`) are read at scrape time by a collector and exposed through
one table, `CORE_COUNTERS`; counters the table does not know yet still appear, as
`slotkeeper_core_<name>_total`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .generation import Outcome

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# core counter -> (metric name without _total, help, labels)
CORE_COUNTERS: dict[str, tuple[str, str, dict[str, str]]] = {
    "prompt_tokens_evaluated": (
        "slotkeeper_prompt_tokens_evaluated",
        "Prompt tokens evaluated (prefilled)",
        {},
    ),
    "prompt_tokens_reused_live": (
        "slotkeeper_prompt_tokens_reused",
        "Prompt tokens reused without evaluation, by source",
        {"source": "live"},
    ),
    "prompt_tokens_reused_checkpoint": (
        "slotkeeper_prompt_tokens_reused",
        "Prompt tokens reused without evaluation, by source",
        {"source": "checkpoint"},
    ),
    "prompt_tokens_reused_logits": (
        "slotkeeper_prompt_tokens_reused",
        "Prompt tokens reused without evaluation, by source",
        {"source": "logits"},
    ),
    "prompt_tokens_reused_after_restore": (
        "slotkeeper_prompt_tokens_reused_after_restore",
        "Prompt tokens reused from restored slot state",
        {},
    ),
    "restores_reprefilled": (
        "slotkeeper_restores_reprefilled",
        "Requests on a restored slot that reused nothing (alert-worthy)",
        {},
    ),
    "checkpoints_created": ("slotkeeper_checkpoints_created", "Checkpoints captured", {}),
    "checkpoints_evicted": (
        "slotkeeper_checkpoints_evicted",
        "Checkpoints dropped by the per-slot budget",
        {},
    ),
    "requests": ("slotkeeper_core_requests", "Requests started by the core", {}),
    "tokens_generated": ("slotkeeper_tokens_generated", "Tokens sampled", {}),
    "slot_saves": ("slotkeeper_slot_saves", "Slot files written", {}),
    "slot_save_bytes": ("slotkeeper_slot_save_bytes", "Bytes of slot files written", {}),
    "slot_restores": ("slotkeeper_slot_restores", "Slot files restored", {}),
    "slot_restore_bytes": ("slotkeeper_slot_restore_bytes", "Bytes of slot files restored", {}),
    "slot_restore_errors": ("slotkeeper_slot_restore_errors", "Slot files refused on restore", {}),
    "decode_errors": ("slotkeeper_decode_errors", "llama_decode failures", {}),
}
_SKIP = {"prompt_tokens_reused_none"}  # always 0: nothing reused is not a source


class _CoreCollector(Collector):
    def __init__(
        self, read: Callable[[], dict[str, int] | None], gauges: Callable[[], dict[str, float]]
    ) -> None:
        self._read = read
        self._gauges = gauges

    def collect(self) -> Iterator[Metric]:
        values = self._read() or {}
        families: dict[str, CounterMetricFamily] = {}
        for key, (name, help_text, labels) in CORE_COUNTERS.items():
            fam = families.get(name)
            if fam is None:
                fam = families[name] = CounterMetricFamily(name, help_text, labels=sorted(labels))
            fam.add_metric([labels[k] for k in sorted(labels)], float(values.get(key, 0)))
        for key in sorted(set(values) - set(CORE_COUNTERS) - _SKIP):
            name = f"slotkeeper_core_{key}"
            families[name] = CounterMetricFamily(name, f"Core counter {key}", value=float(values[key]))
        yield from families.values()
        for name, value in self._gauges().items():
            yield GaugeMetricFamily(name, _GAUGE_HELP.get(name, name), value=value)


_GAUGE_HELP = {
    "slotkeeper_slots_total": "Slots of this engine",
    "slotkeeper_slots_busy": "Slots leased by a request or a slot operation",
    "slotkeeper_queue_waiting": "Requests waiting for a slot",
    "slotkeeper_engine_ready": "1 once the model is loaded",
}


class EngineMetrics:
    """The process's registry: request metrics recorded here, core counters read at scrape time."""

    def __init__(
        self, read_core: Callable[[], dict[str, int] | None], gauges: Callable[[], dict[str, float]]
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.http_requests = Counter(
            "slotkeeper_http_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        self.generations = Counter(
            "slotkeeper_generations",
            "Finished generations by endpoint and stop type",
            ["endpoint", "stop_type"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "slotkeeper_prompt_tokens", "Prompt tokens of finished generations", registry=self.registry
        )
        self.cached_tokens = Counter(
            "slotkeeper_cached_tokens", "Prompt tokens served from the slot (cache_n)", registry=self.registry
        )
        self.completion_tokens = Counter(
            "slotkeeper_completion_tokens", "Tokens generated by finished generations", registry=self.registry
        )
        self.ttft = Histogram(
            "slotkeeper_ttft_seconds",
            "Time to first token, including the wait for a slot",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.registry.register(_CoreCollector(read_core, gauges))
        ProcessCollector(registry=self.registry)

    def generation_done(self, endpoint: str, o: Outcome) -> None:
        self.generations.labels(endpoint or "other", o.stop_type).inc()
        self.prompt_tokens.inc(o.n_prompt)
        self.cached_tokens.inc(o.cache_n)
        self.completion_tokens.inc(o.n_predicted)
        if o.tokens:
            self.ttft.observe(o.ttft_s)

    def http_request(self, route: str, status: int) -> None:
        self.http_requests.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def route_label(path: str, routes: Any) -> str:
    """A low-cardinality route name for a request path (`/slots/3` -> `/slots/{id_slot}`)."""
    for route in routes:
        match = getattr(route, "path_regex", None)
        if match is not None and match.match(path):
            return str(route.path)
    return "other"

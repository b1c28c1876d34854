"""Prometheus metrics of one engine process: its own request metrics and the core's counters.

The registry belongs to the process's Runtime (no module globals, so tests can run several apps).
It also holds prometheus_client's process collector (`process_start_time_seconds`, CPU seconds,
resident memory, open files: what a restart or a leak shows in), read from /proc at scrape time.
The core's counters (`engine.metrics()`) are read at scrape time by a collector and exposed through
one table, `CORE_COUNTERS`; counters the table does not know yet still appear, as
`slotkeeper_core_<name>_total`.

Beside them, llama-server's own families (`llamacpp:*`, the names, types, help lines and meanings
of its /metrics, table `LLAMACPP`): prompt tokens processed and reused, prompt and generation time,
tokens predicted, the longest sequence seen, the speculative-decoding counters (always 0: this
engine drafts nothing), and the gauges. Its rates leave out each decode run's first token (it
comes from the logits of the last prompt batch, not from a decode step) and average the window
since the previous scrape. `llamacpp:n_decode_total` and `llamacpp:n_busy_slots_per_decode` need the
core's count of `llama_decode` calls (`decodes`, `decode_busy_slots`): they appear when the core
reports it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine_pool.process.metric_families import Families

from ..protocol.handoff import ROLES

if TYPE_CHECKING:
    from .decoding import Outcome

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
    "checkpoints_not_stored": (
        "slotkeeper_checkpoints_not_stored",
        "Checkpoints of a slot left out of its slot files by the stored ladder's budget",
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


@dataclass
class _Bucket:
    """Tokens, the decode steps they took and their time (llama-server's `server_metrics::bucket`)."""

    count: int = 0
    steps: int = 0
    seconds: float = 0.0

    def add(self, count: int, steps: int, seconds: float) -> None:
        self.count += count
        self.steps += steps
        self.seconds += seconds

    def rate(self) -> float:
        """Steps per second: tokens that took no decode step do not inflate it."""
        return self.steps / self.seconds if self.seconds > 0 else 0.0


@dataclass
class LlamaStats:
    """What llama-server's /metrics counts, from the decode runs that finished: cumulative since
    the start, and (the `*_window` buckets) since the previous scrape."""

    prompt: _Bucket
    predict: _Bucket
    prompt_window: _Bucket
    predict_window: _Bucket
    prompt_cached: int = 0
    n_tokens_max: int = 0

    @classmethod
    def empty(cls) -> LlamaStats:
        return cls(_Bucket(), _Bucket(), _Bucket(), _Bucket())

    def add(
        self,
        prompt_n: int,
        prompt_ms: float,
        cache_n: int,
        predicted_n: int,
        predicted_ms: float,
        n_tokens: int,
    ) -> None:
        # The first token comes from the logits of the last prompt batch: no decode step.
        steps = max(predicted_n - 1, 0)
        for prompt, predict in ((self.prompt, self.predict), (self.prompt_window, self.predict_window)):
            prompt.add(prompt_n, prompt_n, prompt_ms / 1e3)
            predict.add(predicted_n, steps, predicted_ms / 1e3)
        self.prompt_cached += cache_n
        self.n_tokens_max = max(self.n_tokens_max, n_tokens)


# llama-server's families, in its order: name (after `llamacpp:`) -> help; its counters, then its gauges.
_LLAMACPP_COUNTERS = {
    "prompt_tokens_total": "Number of prompt tokens processed, excluding cached tokens",
    "prompt_tokens_cached_total": "Number of prompt tokens reused from the cache",
    "prompt_seconds_total": "Total time spent processing prompts",
    "tokens_predicted_total": "Number of generation tokens processed",
    "tokens_predicted_seconds_total": "Total time spent generating tokens",
    "n_decode_total": (
        "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding"
    ),
    "n_tokens_max": "Largest observed sequence length (prompt + generation)",
    "spec_decode_num_draft_tokens_total": "Speculative: Total draft tokens generated",
    "spec_decode_num_accepted_tokens_total": "Speculative: Total draft tokens accepted by the target model",
    "spec_decode_num_drafts_total": "Speculative: Total speculative decoding verification steps",
}
_LLAMACPP_GAUGES = {
    "prompt_tokens_seconds": "Average prompt throughput in tokens/s",
    "predicted_tokens_seconds": "Average generation throughput in tokens/s",
    "requests_processing": "Number of requests processing",
    "requests_deferred": "Number of requests deferred",
    "n_busy_slots_per_decode": "Average number of busy slots per llama_decode() call",
}
# (name, type, help) of each family, in llama-server's order.
LLAMACPP: tuple[tuple[str, str, str], ...] = tuple(
    (name, kind, help_text)
    for kind, families in (("counter", _LLAMACPP_COUNTERS), ("gauge", _LLAMACPP_GAUGES))
    for name, help_text in families.items()
)


def llamacpp_values(
    stats: LlamaStats, core: dict[str, int], gauges: dict[str, float], processing: int
) -> dict[str, float]:
    """The value of each `LLAMACPP` family (`processing`: the core's slots running a request); the
    two that count `llama_decode` calls only when the core reports them (`decodes`,
    `decode_busy_slots`)."""
    out = {
        "prompt_tokens_total": float(stats.prompt.count),
        "prompt_tokens_cached_total": float(stats.prompt_cached),
        "prompt_seconds_total": stats.prompt.seconds,
        "tokens_predicted_total": float(stats.predict.count),
        "tokens_predicted_seconds_total": stats.predict.seconds,
        "n_tokens_max": float(stats.n_tokens_max),
        "spec_decode_num_draft_tokens_total": 0.0,  # this engine drafts nothing
        "spec_decode_num_accepted_tokens_total": 0.0,
        "spec_decode_num_drafts_total": 0.0,
        "prompt_tokens_seconds": stats.prompt_window.rate(),
        "predicted_tokens_seconds": stats.predict_window.rate(),
        "requests_processing": float(processing),
        "requests_deferred": gauges.get("slotkeeper_queue_waiting", 0.0),
    }
    if "decodes" in core:
        out["n_decode_total"] = float(core["decodes"])
        out["n_busy_slots_per_decode"] = core.get("decode_busy_slots", 0) / max(core["decodes"], 1)
    return out


def llamacpp_text(values: dict[str, float]) -> str:
    """The families in llama-server's text (HELP, TYPE and value lines, `LLAMACPP`'s order)."""
    lines = []
    for name, kind, help_text in LLAMACPP:
        if name in values:
            value = values[name]
            shown = repr(int(value)) if float(value).is_integer() else repr(value)
            lines += [
                f"# HELP llamacpp:{name} {help_text}",
                f"# TYPE llamacpp:{name} {kind}",
                f"llamacpp:{name} {shown}",
            ]
    return "".join(line + "\n" for line in lines)


class EngineMetrics:
    """The process's registry: request metrics recorded here, core counters read at scrape time."""

    def __init__(
        self,
        read_core: Callable[[], dict[str, int] | None],
        gauges: Callable[[], dict[str, float]],
        role: str = "mixed",
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        family = Families(self.registry, "slotkeeper_")
        self.http_requests = family(
            Counter, "http_requests", "HTTP requests by route and status", "route", "status"
        )
        self.decode_runs = family(
            Counter, "generations", "Finished generations by endpoint and stop type", "endpoint", "stop_type"
        )
        self.prompt_tokens = family(Counter, "prompt_tokens", "Prompt tokens of finished generations")
        self.cached_tokens = family(Counter, "cached_tokens", "Prompt tokens served from the slot (cache_n)")
        self.completion_tokens = family(
            Counter, "completion_tokens", "Tokens generated by finished generations"
        )
        self.ttft = family(
            Histogram,
            "ttft_seconds",
            "Time to first token, including the wait for a slot",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        # Its part in a prefill/decode split (engine_pool.protocol.handoff): 1 for its role, else 0.
        roles = family(Gauge, "engine_role", "This engine's role (1) in a prefill/decode split", "role")
        for name in ROLES:
            roles.labels(name).set(1 if name == role else 0)
        self.registry.register(_CoreCollector(read_core, gauges))
        ProcessCollector(registry=self.registry)
        self._read_core = read_core
        self._gauges = gauges
        self._llama = LlamaStats.empty()

    def decode_done(self, endpoint: str, o: Outcome) -> None:
        self.decode_runs.labels(endpoint or "other", o.stop_type).inc()
        self.prompt_tokens.inc(o.n_prompt)
        self.cached_tokens.inc(o.cache_n)
        self.completion_tokens.inc(o.n_predicted)
        if o.tokens:
            self.ttft.observe(o.ttft_s)
        t = o.timings
        self._llama.add(
            int(t["prompt_n"]),
            t["prompt_ms"],
            o.cache_n,
            o.n_predicted,
            t["predicted_ms"],
            o.n_prompt + o.n_predicted,
        )

    def http_request(self, route: str, status: int) -> None:
        self.http_requests.labels(route, str(status)).inc()

    def render(self, processing: int = 0) -> bytes:
        """Ours, then llama-server's families (`processing`: the core's slots running a request); a
        scrape starts the gauges' next window, as there."""
        # (Both run on the event loop: the stats have one owner.)
        values = llamacpp_values(self._llama, self._read_core() or {}, self._gauges(), processing)
        self._llama.prompt_window, self._llama.predict_window = _Bucket(), _Bucket()
        return generate_latest(self.registry) + llamacpp_text(values).encode()

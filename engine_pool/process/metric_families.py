"""A process's Prometheus families, each declared by its short name under the process's prefix and
registered in the process's one registry (the engine's and the gateway's /metrics)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

Family = TypeVar("Family", Counter, Gauge, Histogram)


@dataclass(frozen=True)
class Families:
    """`families(Counter, "requests", "Requests by path", "path")`: the counter `{prefix}requests`
    of `registry`, labelled by path. `options` are the kind's own (a histogram's `buckets`)."""

    registry: CollectorRegistry
    prefix: str

    def __call__(self, kind: type[Family], name: str, doc: str, *labels: str, **options: Any) -> Family:
        return kind(self.prefix + name, doc, labels, registry=self.registry, **options)

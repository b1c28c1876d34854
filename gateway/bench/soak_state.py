"""What a `slotkeeper bench soak` run shares between its tasks: the honest tenants' counts, each
hostile input's outcomes, the faults, and the constants both the run and the hostile tenant use."""

from __future__ import annotations

import argparse
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

HOSTILE_KEY, HOSTILE_INFLIGHT, HOSTILE_RPM = "sk-soak-mallory", 4, 600
HONEST = {"alpha": "sk-soak-alpha", "beta": "sk-soak-beta"}  # tenant -> key
HEADER_TIMEOUT_S = 10.0  # given to serve; a trickled request head must be cut off by then
MAX_SERIES = 64  # slotkeeper_gateway_requests series allowed after the 404 paths (routes x statuses)
WORDS = "tests parser handler cache retry budget schema branch commit lint deploy index".split()


def retry_after(resp: httpx.Response) -> float | None:
    try:
        return float(resp.headers["retry-after"])
    except (KeyError, ValueError):
        return None


# ------------------------------------------------------------------------------ shared soak state
@dataclass
class HonestStats:
    served: Counter[str] = field(default_factory=Counter)  # 200s per tenant
    throttled: Counter[int] = field(default_factory=Counter)  # 429 / 503, each retried
    no_retry_after: int = 0
    other: Counter[int] = field(default_factory=Counter)  # any other status (goal: none)
    samples: list[str] = field(default_factory=list)  # bodies of those, and transport errors
    sampled: Counter[str] = field(default_factory=Counter)
    transport: int = 0
    latency_ms: dict[str, list[float]] = field(default_factory=dict)  # per tenant, each 200
    turn_ms: list[float] = field(default_factory=list)  # whole turns, Retry-After waits included
    caches: Counter[str] = field(default_factory=Counter)
    forked: int = 0
    deletes: Counter[int] = field(default_factory=Counter)
    lost: dict[str, str] = field(default_factory=dict)  # session -> why
    reprefilled: dict[str, str] = field(default_factory=dict)  # session -> why

    def sample(self, key: object, what: str) -> None:
        """Keep the first three of each kind (a status, an exception), so that none hides another."""
        self.sampled[str(key)] += 1
        if self.sampled[str(key)] <= 3:
            self.samples.append(what[:400])


@dataclass
class Kind:
    """One hostile input: statuses seen, the unexpected ones, answer times."""

    expect: str
    statuses: Counter[str] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    n_unexpected: int = 0
    throttled: int = 0  # 429/503 waited out and sent again
    ms: list[float] = field(default_factory=list)


@dataclass
class Soak:
    """What the tasks share. The faults task alone appends to `kills` and `faults`; each stats part
    has one writer kind (honest workers, hostile tasks)."""

    args: argparse.Namespace
    url: str
    node_url: str
    model: str
    engine_id: str  # the node's first engine, for the unauthenticated slot probes
    key: str
    deadline: float
    kills: list[float] = field(default_factory=list)  # monotonic times of engine SIGKILLs
    faults: list[tuple[str, float, float]] = field(default_factory=list)  # kind, start, end (monotonic)
    durable: dict[str, float] = field(default_factory=dict)  # session -> when a listing showed it saved
    recoveries_s: list[float] = field(default_factory=list)
    not_recovered: int = 0
    engine_pids: set[int] = field(default_factory=set)
    honest: HonestStats = field(default_factory=HonestStats)
    kinds: dict[str, Kind] = field(default_factory=dict)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def at(self) -> str:
        """Seconds since the start, for samples."""
        return f"[{self.args.duration_s - self.left():.0f} s]"

    def kill_free(self, start: float, end: float) -> bool:
        """No fault between ``start`` and ``end``: no SIGKILL, no outage that overlaps them."""
        return not any(start <= k <= end for k in self.kills) and not any(
            f0 <= end and start <= f1 for _, f0, f1 in self.faults
        )

    def note(self, kind: str, status: str, ok: bool, detail: str = "", ms: float | None = None) -> None:
        k = self.kinds[kind]
        k.statuses[status] += 1
        if ms is not None:
            k.ms.append(ms)
        if not ok:
            k.n_unexpected += 1
            if len(k.unexpected) < 3:
                k.unexpected.append(f"{self.at()} {status}: {detail}"[:300])

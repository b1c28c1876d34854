"""`slotkeeper bench gateway`, part 1: what the gateway adds to a request, side by side with the
engine it calls (gateway/bench/gateway.py's doc says how; this module runs it)."""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import httpx

from engine_pool.protocol.chat_types import ChatBody
from gateway.bench.harness.answers import engine_url, timed
from gateway.bench.harness.report import pct, table
from gateway.bench.harness.serve import INTERNAL_AUTH, INTERNAL_KEY, Serve, serving
from gateway.bench.harness.servers import (
    PACKAGE_ROOT,
    free_port,
    listening,
    redis_server,
    stop,
    wait_until,
)
from native.model_gen import cached_model

# The two tenants measured: the request path alone, and every turn followed by a save.
TENANTS_TOML = """
[tenants.lazy]
keys = ["key-lazy"]
durability = "on-evict"
[tenants.durable]
keys = ["key-durable"]
durability = "after-turn"
"""


class EngineOptions(TypedDict, total=False):
    """What a direct call to the engine adds to the chat body: the slot, and its prompt cache."""

    id_slot: int
    cache_prompt: bool


@dataclass
class Target:
    name: str
    url: str
    headers: dict[str, str]
    extra: EngineOptions
    latencies_ms: list[float] = field(default_factory=list)
    prompt_n: list[int] = field(default_factory=list)
    caches: dict[str, int] = field(default_factory=dict)

    def send(self, client: httpx.Client, body: ChatBody, record: bool) -> None:
        t0 = time.perf_counter()
        resp = client.post(self.url, json={**body, **self.extra}, headers=self.headers)
        payload = resp.json()
        elapsed = (time.perf_counter() - t0) * 1000
        if resp.status_code != 200:
            raise RuntimeError(f"{self.name}: HTTP {resp.status_code}: {payload}")
        if record:
            self.latencies_ms.append(elapsed)
            self.prompt_n.append(timed(payload).prompt_n)
            cache = resp.headers.get("x-slotkeeper-cache", "-")
            if resp.headers.get("x-session-id", "") != self.headers.get("X-Session-Id", ""):
                cache += " (forked)"  # the gateway found the session busy and served a copy of it
            self.caches[cache] = self.caches.get(cache, 0) + 1


@dataclass(frozen=True)
class TargetLatency:
    """One target's latencies, and what each adds over the direct engine call (the first)."""

    target: str
    p50_ms: float
    p99_ms: float
    added_p50_ms: float
    added_p99_ms: float
    caches: dict[str, int]  # X-Slotkeeper-Cache -> requests


@dataclass(frozen=True)
class OverheadReport:
    """Part 1 with one index backend."""

    index: str
    rounds: int
    targets: list[TargetLatency]
    early_starts: dict[str, int]  # outcome -> count


def overhead(args: argparse.Namespace, workdir: Path) -> list[OverheadReport]:
    """Once per index backend: serve's in-process Redis, and a redis-server (`--redis-url`)."""
    model = os.path.abspath(args.tiny_model or cached_model(args.models_dir, "qwen35", size="tiny"))
    tenants = workdir / "tenants.toml"
    tenants.write_text(TENANTS_TOML)
    reports = []
    for backend in (
        ("in-process", "redis-server") if args.overhead_index == "both" else (args.overhead_index,)
    ):
        with contextlib.ExitStack() as stack:
            flags = [
                *("--model", model),
                *("--slots", "3"),
                *("--ctx", "2048"),
                *("--tenants", str(tenants)),
                *("--log-level", args.log_level),
            ]
            early_start = "on" if args.early_start == "both" else args.early_start
            serve = _overhead_serve(stack, workdir, backend, "", [*flags, "--early-start", early_start])
            # --early-start both: a second serve without it, its after-turn tenant in the same rounds
            other = None
            if args.early_start == "both":
                off = [*flags, "--early-start", "off"]
                other = _overhead_serve(stack, workdir, backend, "-no-early", off)
            targets, done = _overhead_rounds(serve, args, other)
            early = _early_starts(serve.url)
        _print_overhead(targets, done, args, backend, early)
        reports.append(_overhead_report(targets, done, backend, early))
    return reports


def _overhead_serve(
    stack: contextlib.ExitStack, workdir: Path, backend: str, name: str, flags: list[str]
) -> Serve:
    data = workdir / f"overhead-{backend}{name}"
    flags = [*flags, "--data-dir", str(data)]
    if backend == "redis-server":
        (data / "redis").mkdir(parents=True, exist_ok=True)
        port = stack.enter_context(redis_server(data / "redis"))
        flags += ["--redis-url", f"redis://127.0.0.1:{port}/0"]
    return stack.enter_context(serving(workdir, f"overhead-{backend}{name}", flags))


def _overhead_rounds(
    serve: Serve, args: argparse.Namespace, other: Serve | None = None
) -> tuple[list[Target], int]:
    engine = serve.engines()[0]
    body: ChatBody = {
        "model": engine.model,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 1,
        "temperature": 0,
    }
    gw = serve.url + "/v1/chat/completions"
    targets = [
        Target("gateway, on-evict", gw, {"Authorization": "Bearer key-lazy", "X-Session-Id": "gw-1"}, {}),
        Target(
            "gateway, after-turn", gw, {"Authorization": "Bearer key-durable", "X-Session-Id": "gw-2"}, {}
        ),
    ]
    targets = [t for t in targets if args.overhead_tenants in ("both", t.name.split(", ")[1])]
    extra = []
    with httpx.Client(timeout=60) as client:  # one keep-alive pool per host:port
        if other is not None:  # its own engine (the same model and flags), and its own direct calls
            off = Target(
                "no early start: gateway, after-turn",
                other.url + "/v1/chat/completions",
                {"Authorization": "Bearer key-durable", "X-Session-Id": "gw-3"},
                {},
            )
            off.send(client, body, record=False)
            own = other.engines()[0]
            slot = min(set(range(own.n_slots)) - {_session_slot(other.url, off.headers)})
            url = engine_url(own) + "/v1/chat/completions"
            direct = Target(
                f"no early start: direct engine (slot {slot})",
                url,
                INTERNAL_AUTH,
                {"id_slot": slot, "cache_prompt": True},
            )
            extra = [direct, off]
        for t in targets:  # places both sessions first: the direct target takes the slot left over
            t.send(client, body, record=False)
        used = {_session_slot(serve.url, t.headers) for t in targets}
        free = min(set(range(engine.n_slots)) - used)
        direct = Target(
            f"direct engine (slot {free})",
            engine_url(engine) + "/v1/chat/completions",
            INTERNAL_AUTH,
            {"id_slot": free, "cache_prompt": True},
        )
        targets.insert(0, direct)
        with floor_proxy(engine_url(engine), serve.log.parent) as floor:
            # the same slot as the direct calls (one request at a time: they never overlap)
            targets.insert(1, Target("bare proxy (floor)", floor + "/v1/chat/completions", {}, direct.extra))
            targets += extra
            return targets, _rounds(client, targets, body, args)


@contextmanager
def floor_proxy(engine_url: str, logs: Path) -> Iterator[str]:
    """gateway/bench/floor_proxy.py in front of the engine: the second HTTP hop any Python gateway
    pays, measured in the same rounds (what the gateway adds beyond it is its own work)."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.bench.floor_proxy", "--port", str(port), "--engine", engine_url]
    env = {**os.environ, "SLOTKEEPER_INTERNAL_KEY": INTERNAL_KEY, "PYTHONPATH": str(PACKAGE_ROOT)}
    with (logs / "floor-proxy.log").open("ab") as out:
        proc = subprocess.Popen(
            cmd, cwd=PACKAGE_ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: listening(port), proc, "floor proxy", timeout=60)
        yield url
    finally:
        stop(proc)


def _early_starts(url: str) -> dict[str, int]:
    """The gateway's early starts by outcome (gateway.turn.early), from its /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("slotkeeper_gateway_early_starts_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('outcome="', 1)[1].split('"', 1)[0]] = int(float(value))
    return out


def _overhead_report(
    targets: list[Target], rounds: int, backend: str, early: dict[str, int]
) -> OverheadReport:
    direct = targets[0]
    d50, d99 = pct(direct.latencies_ms, 50), pct(direct.latencies_ms, 99)
    latencies = [
        TargetLatency(
            t.name,
            pct(t.latencies_ms, 50),
            pct(t.latencies_ms, 99),
            pct(t.latencies_ms, 50) - d50,
            pct(t.latencies_ms, 99) - d99,
            t.caches,
        )
        for t in targets
    ]
    return OverheadReport(backend, rounds, latencies, early)


def _session_slot(url: str, headers: dict[str, str]) -> int:
    sid = headers["X-Session-Id"]
    auth = {"Authorization": headers["Authorization"]}
    return int(httpx.get(f"{url}/v1/sessions/{sid}", headers=auth, timeout=5).json()["slot"])


def _rounds(client: httpx.Client, targets: list[Target], body: ChatBody, args: argparse.Namespace) -> int:
    """Warm-up, then rounds of one request per target (the order rotates every round)."""
    deadline = time.monotonic() + args.overhead_time_limit
    done = 0
    for i in range(args.warmup + args.requests):
        if time.monotonic() > deadline:
            break
        k = i % len(targets)
        for t in targets[k:] + targets[:k]:
            t.send(client, body, record=i >= args.warmup)
        done += i >= args.warmup
    return done


def _print_overhead(
    targets: list[Target], rounds: int, args: argparse.Namespace, backend: str, early: dict[str, int]
) -> None:
    direct = targets[0]
    d50, d99 = pct(direct.latencies_ms, 50), pct(direct.latencies_ms, 99)
    rows = []
    for t in targets:
        p50, p99 = pct(t.latencies_ms, 50), pct(t.latencies_ms, 99)
        caches = ",".join(f"{k}:{v}" for k, v in sorted(t.caches.items()))
        over = "" if t is direct else f"{p50 - d50:+.2f}"
        over99 = "" if t is direct else f"{p99 - d99:+.2f}"
        ratio = "" if t is direct else f"{p50 / d50:.2f}"
        rows.append(
            [
                t.name,
                f"{p50:.2f}",
                f"{p99:.2f}",
                over,
                over99,
                ratio,
                f"{statistics.median(t.prompt_n):.0f}",
                caches,
            ]
        )
    print(
        f"\n== 1. gateway overhead ({backend} index): {rounds} interleaved rounds (+{args.warmup} warm-up),"
        " identical chat request, max_tokens=1, tiny qwen35, keep-alive =="
    )
    print(table(["target", "p50 ms", "p99 ms", "+p50 ms", "+p99 ms", "p50 x", "prompt_n", "cache"], rows))
    floor = next((t for t in targets if t.name.startswith("bare proxy")), None)
    if floor is not None:
        f50 = pct(floor.latencies_ms, 50)
        own = ", ".join(
            f"{t.name.split(', ', 1)[1]} {pct(t.latencies_ms, 50) - f50:+.2f} ms"
            for t in targets
            if t.name.startswith("gateway,")
        )
        print(f"beyond the bare proxy's second hop (+{f50 - d50:.2f} ms at p50), the gateway's own: {own}")
    off = [t for t in targets if t.name.startswith("no early start")]
    if len(off) == 2:
        o50 = pct(off[0].latencies_ms, 50)
        print(
            f"no early start (a second serve, the same rounds): its gateway, after-turn, "
            f"{pct(off[1].latencies_ms, 50) - o50:+.2f} ms at p50 over its own engine's direct call "
            f"({o50:.2f} ms)"
        )
    counts = ", ".join(f"{k} {v}" for k, v in sorted(early.items())) or "none"
    print(f"early starts (--early-start {args.early_start}; turns sent beside their opening read): {counts}")
    forked = sum(n for t in targets for k, n in t.caches.items() if "forked" in k)
    if forked:
        print(
            f"WARNING: {forked} requests of this one-at-a-time client were forked: their session was still "
            "locked although the previous response had arrived (a write-behind save releasing its lock); "
            "a fork takes a free slot, possibly the direct target's"
        )

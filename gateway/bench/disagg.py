"""`slotkeeper bench disagg`: the prefill/decode split side by side with two mixed engines.

Per configuration, one `slotkeeper serve` with two engines of one model, each pinned with `taskset`
to its own cores (standing in for separate devices): `unsplit` (two mixed engines, no handoff),
`logits` and `last-token` (a prefill and a decode engine, `--handoff` of that name), and
`logits-nodes` (the prefill engine on one node agent, the decode engine on another, behind one
gateway: the state goes node to node over loopback). K sessions
decode without pause (streamed turns, `--decode-tokens` each, the session live in its slot) while,
after a quiet phase, long prompts of new sessions arrive one after the other. Reported per
configuration: the decoding sessions' inter-token latency p50/p99 in the quiet phase and while long
prompts are in flight, the long prompts' time to first token, their prompt tokens evaluated on the
engine that answered them (`timings.prompt_n`: 0 when the logits were handed over), and the
handoffs' state bytes and transfer time (export + install, from the gateway's `turn.handed_off`
log events). Machines here are shared and noisy: compare rows of one run, and read `uptime` first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

import httpx

from engine_pool.protocol.codec import encode
from engine_pool.protocol.handoff import HandoffResult
from engine_pool.protocol.node import NodeEngine
from gateway.bench.harness.answers import Timings, stream_chunks, timings
from gateway.bench.harness.cluster import clustered
from gateway.bench.harness.serve import serving
from native.model_gen import cached_model

CONFIGS = {  # name -> (roles, --handoff, the engines on two nodes)
    "unsplit": (("mixed", "mixed"), None, False),
    "logits": (("prefill", "decode"), "logits", False),
    "last-token": (("prefill", "decode"), "last-token", False),
    "logits-nodes": (("prefill", "decode"), "logits", True),
}


class Servers(Protocol):
    """What a configuration runs on: `slotkeeper serve`, or a gateway and two nodes."""

    url: str

    def engines(self) -> list[NodeEngine]: ...

    def events(self, name: str, payload: type[T]) -> list[T]: ...

    def tail(self) -> str: ...


T = TypeVar("T")
ROWS = [f"row {i}: sensor {i % 17} read {i * 7 % 101} at {i % 24:02d}h" for i in range(4000)]


@dataclass
class Phase:
    gaps: list[float] = field(default_factory=list)  # seconds between two streamed tokens


@dataclass
class Run:
    quiet: Phase = field(default_factory=Phase)
    busy: Phase = field(default_factory=Phase)
    ttft: list[float] = field(default_factory=list)
    prompt_n: list[int] = field(default_factory=list)  # of the long prompts, where they were answered
    served: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    arrivals_on: bool = False
    stop: bool = False


@dataclass(frozen=True)
class Streamed:
    """How a streamed turn was served (X-Slotkeeper-Cache) and its last timings (None: none)."""

    served: str
    timings: Timings | None


@dataclass(frozen=True)
class ConfigRow:
    """One configuration's run: inter-token latencies quiet and with arrivals, the arrivals' TTFT,
    prompt tokens evaluated where they were answered and how they were served, the handoffs."""

    config: str
    itl_quiet_p50_ms: float
    itl_quiet_p99_ms: float
    itl_busy_p50_ms: float
    itl_busy_p99_ms: float
    itl_busy_max_ms: float
    ttft_s: list[float]
    decode_side_prompt_n: list[int]
    served: list[str]
    handoff_mb: float
    handoff_transfer_ms: float
    handoff_mb_per_s: float | None  # None: nothing handed over
    gaps: tuple[int, int]  # token gaps counted: quiet, busy
    errors: list[str]  # the first three


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def _stream(
    client: httpx.Client, model: str, session: str, messages: list[dict[str, str]], n: int
) -> tuple[list[float], Streamed]:
    """One streamed chat turn: the arrival time of each content chunk, and how it was served."""
    body = {"model": model, "messages": messages, "max_tokens": n, "temperature": 0, "stream": True}
    body["ignore_eos"] = True
    stamps: list[float] = []
    last: Timings | None = None
    with client.stream("POST", "/v1/chat/completions", json=body, headers={"X-Session-Id": session}) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{session}: {r.status_code} {r.text[:300]}")
        served = r.headers.get("X-Slotkeeper-Cache", "")
        for chunk in stream_chunks(r.iter_lines()):
            last = timings(chunk) or last
            choices = chunk.get("choices") or [{}]
            if (choices[0].get("delta") or {}).get("content"):
                stamps.append(time.perf_counter())
    return stamps, Streamed(served, last)


def _decoder(url: str, model: str, k: int, run: Run, n: int, placed: threading.Event) -> None:
    """Session k: streamed turns back to back, the session live in its slot (``placed`` set after
    its first turn); each gap between two tokens counted in the phase it ended in."""
    messages = [{"role": "user", "content": f"Session {k}: count slowly and say nothing else."}]
    with httpx.Client(base_url=url, timeout=600) as client:
        while not run.stop:
            try:
                stamps, _ = _stream(client, model, f"decoder-{k}", messages, n)
            except (httpx.HTTPError, RuntimeError) as exc:
                run.errors.append(str(exc))
                continue
            finally:
                placed.set()
            for a, b in zip(stamps, stamps[1:], strict=False):
                (run.busy if run.arrivals_on else run.quiet).gaps.append(b - a)


def _pin(serve: Servers, cores: list[str]) -> list[NodeEngine]:
    """Each engine's threads onto its own cores (taskset); the engines, as listed."""
    engines = serve.engines()
    for engine, cpus in zip(engines, cores, strict=True):
        pin = ["taskset", "-a", "-p", "-c", cpus, str(engine.pid)]
        subprocess.run(pin, check=True, capture_output=True)
    return engines


@contextmanager
def _servers(config: str, args: argparse.Namespace, model: str, work: Path) -> Iterator[Servers]:
    """The configuration's engines: both under one `slotkeeper serve`, or (across nodes) the
    prefill engine on node n1 and the decode engine on n2, behind one gateway."""
    roles, mode, across = CONFIGS[config]
    slots = ("--slots", str(args.sessions + 1), "--ctx", str(args.ctx))
    split = [
        *("--handoff-threshold", str(args.prompt_tokens // 2) if mode else "off"),
        *("--handoff", mode or "logits"),
        # (a long prompt's prefill on one core outlasts the default bound: it would run unsplit)
        *("--handoff-timeout-s", str(args.handoff_timeout_s)),
    ]
    logging = ["--log-level", "info", "--log-format", "json"]
    env = {**os.environ, "SLOTKEEPER_ENGINE_ARGS": f"-t,{args.threads}"}  # (each node reads it)
    if across:
        nodes = [["--model", model, "--role", role, *slots, "--log-level", "warning"] for role in roles]
        with clustered(work, config, nodes, [*split, *logging], env) as cluster:
            yield cluster
        return
    flags = [
        *("--model", model, "--model", model),
        *("--role", roles[0], "--role", roles[1]),
        *slots,
        *("--data-dir", str(work / config), *logging),
        *split,
    ]
    with serving(work, config, flags, env) as serve:
        yield serve


def _one(config: str, args: argparse.Namespace, model: str, work: Path) -> ConfigRow:
    model_id = Path(model).name.removesuffix(".gguf")
    with _servers(config, args, model, work) as serve:
        deadline = time.monotonic() + 180
        while [e.state for e in serve.engines()] != ["ready", "ready"]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"engines not ready:\n{serve.tail()}")
            time.sleep(0.2)
        _pin(serve, args.cores.split(":"))
        run = Run()
        decoders = []
        for k in range(args.sessions):  # one after the other: each placed seeing the others live
            placed = threading.Event()
            fields = (serve.url, model_id, k, run, args.decode_tokens, placed)
            decoders.append(threading.Thread(target=_decoder, args=fields, daemon=True))
            decoders[-1].start()
            placed.wait(600)
        time.sleep(args.quiet_s)  # the quiet phase: decoding only (a measurement window, not a wait)
        run.arrivals_on = True
        with httpx.Client(base_url=serve.url, timeout=3600) as client:
            for i in range(args.arrivals):
                tool = "\n".join(ROWS[i * 7 :][: args.prompt_tokens // 20])  # (~20 tokens a row)
                text = f"Arrival {i}. The tool's output:\n{tool}\nSummarise."
                messages = [{"role": "user", "content": text}]
                t0 = time.perf_counter()
                stamps, last = _stream(client, model_id, f"arrival-{config}-{i}", messages, 4)
                run.ttft.append((stamps[0] if stamps else time.perf_counter()) - t0)
                run.prompt_n.append(last.timings.prompt_n if last.timings else -1)
                run.served.append(last.served)
        run.arrivals_on = False
        run.stop = True
        for t in decoders:
            t.join(600)
        handed = serve.events("turn.handed_off", HandoffResult)
    moved = [h for h in handed if h.bytes]
    state = sum(h.bytes for h in moved)
    transfer_ms = sum(h.export_ms + h.install_ms for h in moved)
    return ConfigRow(
        config=config,
        itl_quiet_p50_ms=1e3 * _pct(run.quiet.gaps, 50),
        itl_quiet_p99_ms=1e3 * _pct(run.quiet.gaps, 99),
        itl_busy_p50_ms=1e3 * _pct(run.busy.gaps, 50),
        itl_busy_p99_ms=1e3 * _pct(run.busy.gaps, 99),
        itl_busy_max_ms=1e3 * max(run.busy.gaps, default=float("nan")),
        ttft_s=[round(x, 2) for x in run.ttft],
        decode_side_prompt_n=run.prompt_n,
        served=run.served,
        handoff_mb=round(state / 1e6, 1),
        handoff_transfer_ms=round(transfer_ms, 1),
        handoff_mb_per_s=round(state / 1e3 / transfer_ms, 0) if transfer_ms else None,
        gaps=(len(run.quiet.gaps), len(run.busy.gaps)),
        errors=run.errors[:3],
    )


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="slotkeeper bench disagg", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a GGUF (default: the generated qwen35 bench model)")
    ap.add_argument("--models-dir", default=os.path.join(tempfile.gettempdir(), "slotkeeper-bench-models"))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--sessions", type=int, default=2, help="K sessions decoding (2)")
    ap.add_argument("--decode-tokens", type=int, default=32, help="tokens per decoding turn (32)")
    ap.add_argument("--arrivals", type=int, default=2, help="long prompts, one after the other (2)")
    ap.add_argument("--prompt-tokens", type=int, default=8192, help="about this long (8192)")
    ap.add_argument("--ctx", type=int, default=0, help="tokens per slot (2 x prompt + 1024)")
    ap.add_argument("--quiet-s", type=float, default=15.0, help="decoding alone first, seconds (15)")
    ap.add_argument("--threads", type=int, default=1, help="threads per engine (1)")
    ap.add_argument("--cores", default="0:1", help="taskset CPU lists of engine 0 and 1 (0:1)")
    ap.add_argument(
        "--handoff-timeout-s", type=float, default=3600.0, help="the longest a prefill may take (3600)"
    )
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args(argv)
    args.ctx = args.ctx or args.prompt_tokens * 2 + 1024
    model = args.model or cached_model(args.models_dir, "qwen35", size="bench")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; model {model}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-disagg-") as tmp:
        for config in args.configs.split(","):
            row = _one(config, args, model, Path(tmp))
            rows.append(row)
            print(json.dumps(encode(row)), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end", flush=True)
    print(
        "| config | ITL p50 / p99 quiet (ms) | ITL p50 / p99 / max with arrivals (ms) | TTFT (s) | "
        "prompt_n where answered | state MB, transfer ms (MB/s) |\n|---|---|---|---|---|---|"
    )
    for r in rows:
        mb, ms, rate = r.handoff_mb, r.handoff_transfer_ms, r.handoff_mb_per_s
        moved = f"{mb} MB, {ms} ms ({rate})" if mb else "-"
        print(
            f"| {r.config} | {r.itl_quiet_p50_ms:.0f} / {r.itl_quiet_p99_ms:.0f} | "
            f"{r.itl_busy_p50_ms:.0f} / {r.itl_busy_p99_ms:.0f} / {r.itl_busy_max_ms:.0f} | "
            f"{', '.join(map(str, r.ttft_s))} | "
            f"{', '.join(map(str, r.decode_side_prompt_n))} | {moved} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps([encode(r) for r in rows], indent=2))
    return 0

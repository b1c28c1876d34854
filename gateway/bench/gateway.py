"""`slotkeeper bench gateway`: what the gateway costs, measured side by side in one run (the machines
are shared and noisy: compare the ratios, not the absolute times).

1. overhead — `slotkeeper serve` on the tiny qwen35: the same small chat request (max_tokens 1)
   through the gateway on a live session and straight to the engine on another slot, interleaved
   so that noise hits both; p50/p99 of each and the gateway's overhead. Two gateway tenants run in
   the same rounds: `on-evict` (the request path alone) and `after-turn` (the default durability:
   every turn is followed by a write-behind save of the slot). A bare forwarding proxy
   (`floor_proxy.py`: uvicorn + the gateway's engine client, nothing else) runs in the same rounds:
   the second HTTP hop any Python gateway pays on this host, so the gateway's own work shows apart.
2. routing — `gateway/bench/routing.py` (also `slotkeeper bench routing` alone): the gateway's decision per
   request over 100,000 indexed sessions, in process and with a real redis-server, stage by stage.
3. restore — the bench model (~211M params) behind `slotkeeper serve` with S3 (moto's server):
   the TTFT of the same second turn of a ~4,000-token session served live, and served after
   SIGTERM (drain to S3) + wiping the local spill cache, blobs and slot files + a fresh start, so
   the state comes back from S3 through reindex and fill.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from engine_pool.protocol.codec import Wire
from engine_pool.protocol.node import FillResult
from gateway.bench import routing
from gateway.bench.harness.answers import Timings, Tokens, engine_url, stream_chunks, timings
from gateway.bench.harness.prompts import CHUNK, SYSTEM
from gateway.bench.harness.report import table
from gateway.bench.harness.serve import INTERNAL_AUTH, Serve, start_serve
from gateway.bench.harness.servers import (
    AWS_ENV,
    MotoProcess,
)
from gateway.bench.overhead import OverheadReport, overhead
from gateway.bench.routing import RoutingReport
from native.model_gen import cached_model

BUCKET = "slots"  # created by MotoProcess before it listens


# ================================================================================ 3. restored TTFT
@dataclass(frozen=True)
class TurnResult:
    ttft_ms: float
    total_ms: float
    content: str
    timings: Timings | None  # the stream's last; None when it carried none
    cache: str


def stream_turn(
    url: str, model: str, messages: list[dict[str, str]], session: str, n_predict: int
) -> TurnResult:
    """One streamed chat turn; TTFT = the first chunk that carries generated text."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": n_predict,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    content: list[str] = []
    last: Timings | None = None
    ttft: float | None = None
    t0 = time.perf_counter()
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=body, headers={"X-Session-Id": session}, timeout=300
    ) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"turn failed: HTTP {resp.status_code}: {resp.read()!r}")
        cache = resp.headers.get("x-slotkeeper-cache", "-")
        for chunk in stream_chunks(resp.iter_lines()):
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            last = timings(chunk) or last
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                text = delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
                if text and ttft is None:
                    ttft = time.perf_counter() - t0
                content.append(delta.get("content") or "")
    total = time.perf_counter() - t0
    return TurnResult((ttft or total) * 1000, total * 1000, "".join(content), last, cache)


def long_prompt(serve: Serve, tokens: int) -> list[dict[str, str]]:
    """System + a user message of about `tokens` tokens (counted with the engine's tokenizer)."""
    engine = engine_url(serve.engines()[0])
    tokenized = httpx.post(engine + "/tokenize", json={"content": CHUNK}, headers=INTERNAL_AUTH, timeout=30)
    per_chunk = len(Tokens.from_json(tokenized.json()).tokens)
    user = "Review this code:\n" + CHUNK * max(1, (tokens - 60) // per_chunk)
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def _wait_durable(url: str, session: str, timeout: float = 120) -> None:
    """The write-behind save of the last turn finished (the agent's next turn comes after it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(f"{url}/v1/sessions/{session}", timeout=5).json().get("generation", 0) >= 1:
            return
        time.sleep(0.1)
    raise RuntimeError(f"session {session} was not saved within {timeout}s")


def wipe_local(data: Path) -> int:
    """Remove the spill cache, the local blobs and every slot file; returns the bytes removed."""
    victims = [p for p in (data / "spill", data / "blobs") if p.exists()]
    files = [p for v in victims for p in v.rglob("*") if p.is_file()] + list(data.rglob("*.slot"))
    size = sum(p.stat().st_size for p in files if p.exists())
    for v in victims:
        shutil.rmtree(v)
    for p in data.rglob("*.slot"):
        p.unlink()
    return size


@dataclass(frozen=True)
class Restart:
    """A pass's restart: SIGTERM to exit, the local state wiped, a fresh start to ready."""

    drain_s: float
    wiped_bytes: int
    start_s: float


@dataclass(frozen=True)
class Pass:
    turn1: TurnResult
    turn2: TurnResult
    messages2: list[dict[str, str]]
    restart: Restart | None  # None: turn 2 served live
    fill: FillResult | None  # the node's last fill (its `node.filled` event), if any


def _serve_flags(args: argparse.Namespace, model: str, data: Path, endpoint: str, prefix: str) -> list[str]:
    return [
        *("--data-dir", str(data)),
        *("--model", model),
        *("--slots", "1"),
        *("--ctx", str(args.ctx)),
        *("--s3-endpoint", endpoint),
        *("--s3-bucket", BUCKET),
        *("--s3-prefix", prefix),
        *("--log-level", "info"),
    ]


def run_pass(args: argparse.Namespace, workdir: Path, endpoint: str, name: str, restart: bool) -> Pass:
    model = os.path.abspath(args.bench_model or cached_model(args.models_dir, "qwen35", size="bench"))
    data = workdir / name
    flags = _serve_flags(args, model, data, endpoint, f"bench-{name}-{os.getpid()}")
    env = {**os.environ, **AWS_ENV}
    session = f"agent-{name}"
    serve = start_serve(workdir, f"restore-{name}", flags, env)
    try:
        model_id = serve.engines()[0].model
        msgs = long_prompt(serve, args.tokens)
        turn1 = stream_turn(serve.url, model_id, msgs, session, args.n_predict)
        msgs2 = msgs + [
            {"role": "assistant", "content": turn1.content},
            {"role": "user", "content": "Fix the bug in handler and run the tests."},
        ]
        _wait_durable(serve.url, session)
        restarted = None
        if restart:
            serve, restarted = _restart(serve, workdir, name, flags, env, data, args)
        turn2 = stream_turn(serve.url, model_id, msgs2, session, args.n_predict)
        fills = serve.events("node.filled", FillResult)
        return Pass(turn1, turn2, msgs2, restarted, fills[-1] if fills else None)
    finally:
        serve.close(timeout=args.drain_timeout)


def _restart(
    serve: Serve,
    workdir: Path,
    name: str,
    flags: list[str],
    env: dict[str, str],
    data: Path,
    args: argparse.Namespace,
) -> tuple[Serve, Restart]:
    t0 = time.perf_counter()
    rc = serve.terminate(timeout=args.drain_timeout)
    drain_s = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"serve did not drain cleanly (exit {rc}):\n{serve.tail()}")
    wiped = wipe_local(data)
    t0 = time.perf_counter()
    fresh = start_serve(workdir, f"restore-{name}-restarted", flags, env)
    return fresh, Restart(drain_s, wiped, time.perf_counter() - t0)


def restore(args: argparse.Namespace, workdir: Path) -> int:
    """`--repeat` pairs of passes in A B, B A, ... order (drift hits both cases alike)."""
    moto = MotoProcess(workdir)
    moto.start()
    live: list[Pass] = []
    back: list[Pass] = []
    try:
        for r in range(args.repeat):
            order = [False, True] if r % 2 == 0 else [True, False]
            for restart in order:
                name = f"{'b' if restart else 'a'}{r}"
                (back if restart else live).append(run_pass(args, workdir, moto.endpoint, name, restart))
    finally:
        moto.kill()
    return _print_restore(live, back)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _prompt_n(t: TurnResult) -> int | None:
    return t.timings.prompt_n if t.timings else None


def _shown(count: int | None) -> str:
    return "?" if count is None else str(count)


def _turn_row(name: str, turns: list[TurnResult]) -> list[str]:
    ttft = [t.ttft_ms for t in turns]
    engine_ms = [t.timings.prompt_ms if t.timings else math.nan for t in turns]
    return [
        name,
        ",".join(sorted({t.cache for t in turns})),
        ", ".join(f"{v:.0f}" for v in ttft),
        f"{_median(ttft):.0f}",
        ",".join(sorted({_shown(_prompt_n(t)) for t in turns})),
        ",".join(sorted({_shown(t.timings.cache_n if t.timings else None) for t in turns})),
        f"{_median(engine_ms):.0f}",
    ]


def _restart_line(back: list[Pass]) -> str:
    restarts = [p.restart for p in back]
    drain_s = _median([r.drain_s if r else math.nan for r in restarts])
    wiped_mib = _median([r.wiped_bytes / 2**20 if r else math.nan for r in restarts])
    start_s = _median([r.start_s if r else math.nan for r in restarts])
    fills = [p.fill for p in back]
    sources = ",".join(sorted({str(f.source) if f else "None" for f in fills}))
    fill_mib = _median([f.bytes / 2**20 if f else math.nan for f in fills])
    fill_ms = _median([f.ms if f else math.nan for f in fills])
    return (
        f"restart (medians): drain (SIGTERM -> exit) {drain_s:.1f} s, wiped "
        f"{wiped_mib:.0f} MiB of local state, start to ready {start_s:.1f} s; "
        f"fill from {sources}: {fill_mib:.1f} MiB in {fill_ms:.0f} ms (download + restore, inside the "
        "restored TTFT)"
    )


def _print_restore(live: list[Pass], back: list[Pass]) -> int:
    passes = live + back
    first = _shown(_prompt_n(passes[0].turn1))
    print(
        f"\n== 3. restored vs live turn: bench qwen35, {first}-token first prompt, serve with S3 (moto), "
        f"{len(live)} pass(es) each way =="
    )
    rows = [
        _turn_row("cold turn 1", [p.turn1 for p in passes]),
        _turn_row("live turn 2", [p.turn2 for p in live]),
        _turn_row("restored turn 2 (restart, from S3)", [p.turn2 for p in back]),
    ]
    header = ["turn", "served", "TTFT ms (each)", "TTFT p50", "prompt_n", "cache_n", "engine prompt ms p50"]
    print(table(header, rows))
    live_ms = _median([p.turn2.ttft_ms for p in live])
    back_ms = _median([p.turn2.ttft_ms for p in back])
    cold_ms = _median([p.turn1.ttft_ms for p in passes])
    print(
        f"restored/live TTFT (medians): {back_ms / live_ms:.2f}x ({back_ms - live_ms:+.0f} ms); "
        f"restored/cold: {back_ms / cold_ms:.3f}; live/cold: {live_ms / cold_ms:.3f}"
    )
    print(_restart_line(back))
    same_turn = all(p.messages2 == passes[0].messages2 for p in passes)
    prompt_ns = {_prompt_n(p.turn2) for p in passes}
    same_out = len({p.turn2.content for p in passes}) == 1
    print(
        f"same turn-2 messages in every pass: {same_turn}; turn-2 prompt_n equal: {len(prompt_ns) == 1}; "
        f"same turn-2 output: {same_out}"
    )
    restored = all(p.turn2.cache == "restored" for p in back) and all(
        p.fill is not None and p.fill.source == "store" for p in back
    )
    return 0 if same_turn and len(prompt_ns) == 1 and restored else 1


# ========================================================================================= command
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="slotkeeper bench gateway",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--only",
        action="append",
        choices=["overhead", "routing", "restore"],
        help="run only this part (repeatable; default: all three)",
    )
    ap.add_argument("--models-dir", default=os.path.join(".bench", "models"))
    ap.add_argument("--workdir", help="keep logs and data here (default: a temporary directory)")
    ap.add_argument("--json", help="also write the results here as JSON")
    g = ap.add_argument_group("1. overhead")
    g.add_argument("--tiny-model", help="GGUF (default: the generated tiny qwen35)")
    g.add_argument("--requests", type=int, default=200, help="measured requests per target")
    g.add_argument("--warmup", type=int, default=10, help="unmeasured rounds first")
    g.add_argument("--overhead-time-limit", type=float, default=120.0, help="seconds, at most")
    g.add_argument("--log-level", default="info", help="serve's log level (its default: info)")
    g.add_argument(
        "--overhead-index",
        choices=["in-process", "redis-server", "both"],
        default="both",
        help="serve's index: its in-process Redis, a redis-server, or each",
    )
    g.add_argument(
        "--early-start",
        choices=["on", "off", "both"],
        default="on",
        help="serve's --early-start (a held session's turn sent beside its opening read); "
        "both: a second serve without it in the same rounds",
    )
    g.add_argument(
        "--overhead-tenants",
        choices=["on-evict", "after-turn", "both"],
        default="both",
        help="the tenants measured (after-turn saves share the cores with all)",
    )
    routing.add_arguments(ap)
    g = ap.add_argument_group("3. restore")
    g.add_argument("--bench-model", help="GGUF (default: the generated qwen35 bench model)")
    g.add_argument("--tokens", type=int, default=4000, help="approximate first-prompt length")
    g.add_argument("--ctx", type=int, default=8192)
    g.add_argument("--n-predict", type=int, default=16)
    g.add_argument("--repeat", type=int, default=2, help="pairs of passes (each pays one cold turn)")
    g.add_argument("--drain-timeout", type=float, default=180.0)
    return ap


@dataclass(frozen=True)
class GatewayReport(Wire):
    """What `--json` writes: the parts that ran (the others absent)."""

    sparse = True
    bench: str
    overhead: list[OverheadReport] | None = None
    routing: list[RoutingReport] | None = None
    restore_ok: bool | None = None


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    parts = args.only or ["overhead", "routing", "restore"]
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        workdir = Path(args.workdir or tmp).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        rc = 0
        t0 = time.perf_counter()
        overheads = overhead(args, workdir) if "overhead" in parts else None
        routings = routing.routing(args, workdir) if "routing" in parts else None
        restore_ok = None
        if "restore" in parts:
            rc = restore(args, workdir)
            restore_ok = rc == 0
        if args.json:
            report = GatewayReport("gateway", overheads, routings, restore_ok)
            Path(args.json).write_text(json.dumps(report.to_json(), indent=2))
        print(
            f"\n(wall {time.perf_counter() - t0:.0f} s; logs in {workdir if args.workdir else 'a temp dir'})"
        )
    return rc

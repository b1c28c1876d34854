"""`slotkeeper bench throughput`: prefill and decode tokens/s of one engine with 1, 2 and 4 busy slots,
ours and (`--upstream`) llama-server's side by side.

Against a running engine (`--url`), or servers this script starts on `--model` — by default the
generated qwen35 bench model (~400 MB f16, deterministic) — with the same flags
(gateway.bench.harness.upstream: `-np` = the largest concurrency, same context, threads, batch
sizes, flash attention off). Each round sends N concurrent /completion requests, one per slot, with
distinct prompts, no prompt cache and `ignore_eos`, twice: prefill (prompts of about
`--prompt-tokens` tokens, one token generated) and decode (two-word prompts, `--n-predict` tokens
generated). Reported per level: prompt tokens per second and generated tokens per second of the
round's wall time, on the client's clock — the same measure for both servers, whatever each one
reports in its own timings. With `--upstream` the servers take turns (`--repeat` times each, one at
a time: never both on the CPU) and the best round of each is compared. Machines here are shared and
noisy: compare rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from engine_pool.protocol.codec import Wire
from gateway.bench.harness.answers import Timings, timed
from gateway.bench.harness.upstream import Flags, start
from native.model_gen import cached_model

WORDS = (
    "the model state is saved in a slot cache then restored for the user every session keeps its "
    "state so that the next turn only has to process what is new agents call tools and read files"
).split()


@dataclass(frozen=True)
class Round:
    """N concurrent requests: the round's wall time, prompt tokens evaluated and tokens generated."""

    wall_s: float
    prompt_tokens: int
    generated: int


@dataclass(frozen=True)
class Level:
    """One concurrency level: its rates on the client's clock, and the two rounds they come from."""

    slots: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    prefill: Round
    decode: Round


@dataclass(frozen=True)
class Best:
    """A level's best rates over the runs."""

    slots: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


@dataclass(frozen=True)
class Ratio:
    """Ours over llama-server's, at one level."""

    slots: int
    prefill_ratio: float
    decode_ratio: float


@dataclass(frozen=True)
class UrlReport(Wire):
    """`--json` against a running engine (`--url`)."""

    url: str
    rows: list[Level]


@dataclass(frozen=True)
class ServersReport(Wire):
    """`--json` for the servers this script starts: every run, the best of each level, and (with
    `--upstream`) the ratios; `ratios` absent without it."""

    sparse = True
    runs: dict[str, list[list[Level]]]  # per server kind, per run
    best: dict[str, list[Best]]
    ratios: list[Ratio] | None = None


def _prompt(i: int, n_words: int) -> str:
    # Distinct from the first word on, so no two requests share a prefix.
    return f"Request {i}: " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(n_words))


def _flags(args: argparse.Namespace, n_slots: int) -> Flags:
    model = args.model or cached_model(args.models_dir, "qwen35", size="bench")
    return Flags(
        model,
        slots=n_slots,
        ctx=n_slots * (args.prompt_tokens * 2 + args.n_predict + 64),
        threads=args.threads,
    )


async def _round(client: httpx.AsyncClient, n: int, words: int, n_predict: int, tag: int) -> Round:
    """N concurrent requests, one per slot, distinct prompts of `words` words, no prompt cache."""

    async def one(i: int) -> Timings:
        body = {
            "prompt": _prompt(i + 100 * tag, words),
            "id_slot": i,
            "n_predict": n_predict,
            "ignore_eos": True,
            "temperature": 0,
            "cache_prompt": False,
        }
        r = await client.post("/completion", json=body)
        if r.status_code != 200:  # the server's reason (llama-server holds a slot to the model's
            # training context: a prompt past it is refused), not a traceback
            raise SystemExit(f"{client.base_url}/completion answered {r.status_code}: {r.text[:500]}")
        return timed(r.json())

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - t0
    return Round(wall, sum(t.prompt_n for t in results), sum(t.predicted_n for t in results))


async def _level(client: httpx.AsyncClient, n: int, args: argparse.Namespace, words: int) -> Level:
    """One concurrency level, measured by the client's clock (both servers alike): prefill = long
    prompts, one token each; decode = a few-word prompt, `--n-predict` tokens each."""
    pre = await _round(client, n, words, 1, 1 + n)
    dec = await _round(client, n, 2, args.n_predict, 50 + n)
    return Level(n, pre.prompt_tokens / pre.wall_s, dec.generated / dec.wall_s, pre, dec)


async def _bench(url: str, args: argparse.Namespace, concurrency: list[int]) -> list[Level]:
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout) as client:
        props = (await client.get("/props")).json()
        arch = (props.get("slotkeeper") or {}).get("arch", "llama-server")
        if props["total_slots"] < max(concurrency):
            raise SystemExit(f"the engine has {props['total_slots']} slots; need {max(concurrency)}")
        words = max(1, args.prompt_tokens // 2)
        tokens = (await client.post("/tokenize", json={"content": _prompt(0, words)})).json()["tokens"]
        words = max(1, int(words * args.prompt_tokens / max(len(tokens), 1)))
        print(
            f"model {props['model_path']} ({arch}); prefill: prompts of ~{args.prompt_tokens} tokens; "
            f"decode: {args.n_predict} tokens per request",
            flush=True,
        )
        await _round(client, 1, words, 4, 0)  # warm-up
        rows = []
        for n in concurrency:
            row = await _level(client, n, args, words)
            rows.append(row)
            print(
                f"  {n} busy slot(s): prefill {row.prefill_tokens_per_s:8.1f} tok/s, "
                f"decode {row.decode_tokens_per_s:7.1f} tok/s",
                flush=True,
            )
        return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="slotkeeper bench throughput", description=__doc__)
    ap.add_argument("--url", help="a running engine (default: start one on --model)")
    ap.add_argument("--model", help="GGUF model (default: the generated qwen35 bench model)")
    ap.add_argument("--models-dir", default=os.path.join(".bench", "models"))
    ap.add_argument("--slots", default="1,2,4", help="concurrency levels, comma-separated (1,2,4)")
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0, help="engine threads (0: all)")
    ap.add_argument("--upstream", action="store_true", help="also run llama-server, taking turns")
    ap.add_argument("--repeat", type=int, default=2, help="runs per server with --upstream (best kept)")
    ap.add_argument("--request-timeout", type=float, default=1800.0)
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    concurrency = [int(x) for x in args.slots.split(",") if x.strip()]

    report: Wire
    if args.url is not None:
        report = UrlReport(args.url, asyncio.run(_bench(args.url, args, concurrency)))
    else:
        kinds = ("slotkeeper", "llama-server") if args.upstream else ("slotkeeper",)
        runs: dict[str, list[list[Level]]] = {k: [] for k in kinds}
        with tempfile.TemporaryDirectory(prefix="bench-throughput-") as tmp:
            for _ in range(args.repeat if args.upstream else 1):
                for kind in kinds:  # one server at a time: never both on the CPU
                    print(f"\n-- {kind}", flush=True)
                    srv = start(kind, _flags(args, max(concurrency)), Path(tmp) / f"{kind}.log")
                    try:
                        runs[kind].append(asyncio.run(_bench(srv.url, args, concurrency)))
                    finally:
                        srv.stop()
        best = {k: [_best(rounds, i) for i in range(len(concurrency))] for k, rounds in runs.items()}
        ratios = _print_ratios(best, concurrency) if args.upstream else None
        report = ServersReport(runs, best, ratios)
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2))
    return 0


def _best(runs: list[list[Level]], i: int) -> Best:
    """The i-th concurrency level's best round over the runs (noise only ever slows a run down)."""
    rows = [run[i] for run in runs]
    return Best(
        rows[0].slots,
        max(r.prefill_tokens_per_s for r in rows),
        max(r.decode_tokens_per_s for r in rows),
    )


def _print_ratios(best: dict[str, list[Best]], concurrency: list[int]) -> list[Ratio]:
    print(
        f"\n{'busy slots':>10} {'prefill ours':>13} {'llama-srv':>10} {'ratio':>6} {'decode ours':>12} "
        f"{'llama-srv':>10} {'ratio':>6}"
    )
    out = []
    for ours, up in zip(best["slotkeeper"], best["llama-server"], strict=True):
        p = ours.prefill_tokens_per_s / max(up.prefill_tokens_per_s, 1e-9)
        d = ours.decode_tokens_per_s / max(up.decode_tokens_per_s, 1e-9)
        cells = [
            ours.prefill_tokens_per_s,
            up.prefill_tokens_per_s,
            p,
            ours.decode_tokens_per_s,
            up.decode_tokens_per_s,
            d,
        ]
        widths = ((13, 1), (10, 1), (6, 2), (12, 1), (10, 1), (6, 2))
        print(
            f"{ours.slots:>10} " + " ".join(f"{c:{w}.{k}f}" for c, (w, k) in zip(cells, widths, strict=True))
        )
        out.append(Ratio(ours.slots, p, d))
    return out

"""`slotkeeper bench throughput`: aggregate generated tokens/s of one engine with 1, 2 and 4 busy slots.

Against a running engine (`--url`), or one this script starts (`slotkeeper engine`, one process,
`-np` = the largest concurrency) on `--model` — by default the generated qwen35 bench model, written
to `--models-dir` first if absent (~400 MB f16, deterministic). Each round sends N concurrent
/completion requests, one per slot, with distinct prompts of about `--prompt-tokens` tokens, no
prompt cache and `ignore_eos`, so every request prefills its prompt and generates exactly
`--n-predict` tokens. Reported per round: wall time, aggregate generated tokens/s over the round's
wall time (prefill included), and the decode-only rate (sum of generated tokens over the longest
request's generation time). Machines here are shared and noisy: compare rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from native.model_gen import cached_model

WORDS = (
    "the model state is saved in a slot cache then restored for the user every session keeps its "
    "state so that the next turn only has to process what is new agents call tools and read files"
).split()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prompt(i: int, n_words: int) -> str:
    # Distinct from the first word on, so no two requests share a prefix.
    return f"Request {i}: " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(n_words))


def _start_engine(args: argparse.Namespace, n_slots: int, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    model = args.model or cached_model(args.models_dir, "qwen35", size="bench")
    port = _free_port()
    ctx = n_slots * (args.prompt_tokens * 2 + args.n_predict + 64)
    cmd = [
        sys.executable,
        "-m",
        "gateway.cli",
        "engine",
        "-m",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(n_slots),
        "-c",
        str(ctx),
        "-t",
        str(args.threads),
        "--log-level",
        "warning",
    ]
    print(f"starting: {' '.join(cmd)}", flush=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.load_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"engine exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise SystemExit(f"engine not healthy after {args.load_timeout} s; see {log}")


async def _round(client: httpx.AsyncClient, n: int, args: argparse.Namespace, words: int) -> dict[str, Any]:
    async def one(i: int) -> dict[str, Any]:
        body = {
            "prompt": _prompt(i + 100 * n, words),
            "id_slot": i,
            "n_predict": args.n_predict,
            "ignore_eos": True,
            "temperature": 0,
            "cache_prompt": False,
        }
        r = await client.post("/completion", json=body)
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - t0
    generated = sum(r["timings"]["predicted_n"] for r in results)
    decode_s = max(r["timings"]["predicted_ms"] for r in results) / 1000.0
    return {
        "slots": n,
        "wall_s": wall,
        "prompt_tokens": sum(r["timings"]["prompt_n"] for r in results),
        "generated": generated,
        "tokens_per_s": generated / wall,
        "decode_tokens_per_s": generated / decode_s if decode_s > 0 else 0.0,
        "per_request_tokens_per_s": [round(r["timings"]["predicted_per_second"], 2) for r in results],
    }


async def _bench(url: str, args: argparse.Namespace, concurrency: list[int]) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout) as client:
        props = (await client.get("/props")).json()
        if props["total_slots"] < max(concurrency):
            raise SystemExit(f"the engine has {props['total_slots']} slots; need {max(concurrency)}")
        words = max(1, args.prompt_tokens // 2)
        tokens = (await client.post("/tokenize", json={"content": _prompt(0, words)})).json()["tokens"]
        words = max(1, int(words * args.prompt_tokens / max(len(tokens), 1)))
        print(
            f"model {props['model_path']} ({props['slotkeeper']['arch']}); prompts of ~{args.prompt_tokens} "
            f"tokens; {args.n_predict} generated per request",
            flush=True,
        )
        await _round(client, 1, argparse.Namespace(**{**vars(args), "n_predict": 4}), words)  # warm-up
        rows = []
        for n in concurrency:
            row = await _round(client, n, args, words)
            rows.append(row)
            print(
                f"  {n} busy slot(s): {row['generated']:5d} tokens in {row['wall_s']:7.2f} s -> "
                f"{row['tokens_per_s']:8.2f} tok/s aggregate, "
                f"{row['decode_tokens_per_s']:8.2f} tok/s decode-only "
                f"(per request: {row['per_request_tokens_per_s']})",
                flush=True,
            )
        return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="slotkeeper bench throughput", description=__doc__)
    ap.add_argument("--url", help="a running engine (default: start one on --model)")
    ap.add_argument("--model", help="GGUF model (default: the generated qwen35 bench model)")
    ap.add_argument("--models-dir", default=os.path.join(".bench", "models"))
    ap.add_argument("--slots", default="1,2,4", help="concurrency levels, comma-separated (1,2,4)")
    ap.add_argument("--n-predict", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="engine threads (0: all)")
    ap.add_argument("--load-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=1800.0)
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    concurrency = [int(x) for x in args.slots.split(",") if x.strip()]

    proc = None
    url = args.url
    log = Path(tempfile.gettempdir()) / f"bench_throughput_engine_{os.getpid()}.log"
    if url is None:
        proc, url = _start_engine(args, max(concurrency), log)
    try:
        rows = asyncio.run(_bench(url, args, concurrency))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

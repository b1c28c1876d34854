"""`slotkeeper bench fuzz`: malformed and valid bodies for N minutes; no answer may be a 5xx.

The generators of tests/*/test_fuzz.py (gateway.bench.harness.fuzz_bodies: OpenAI's and Anthropic's
published request schemas, llama-server's from its README; valid bodies, mutated ones, raw bytes)
against the targets it starts on a tiny qwen35 model:

- `gateway`: `slotkeeper serve` (gateway + node agent + engine), its tenant endpoints;
- `engine`: one `slotkeeper engine` (the llama-server drop-in), those and llama-server's own;
- `llama-server`: upstream llama-server on the same model and flags (`--target llama-server`, from
  the `bench` extra), for comparison only: its 5xx are listed, not counted against us.

Round after round, every (target, endpoint) pair gets a hypothesis run of `--batch` examples until the
time is up. Printed: requests per endpoint, a status-code histogram, and every 5xx (or unacceptable
answer: a 4xx outside the API's error shape, a stream that reports a server fault, no answer) with
its answer; the request that caused it is saved under `--out`. Then each target must still serve a
valid request. Exit 0 only when no target of ours gave a 5xx.

It is not a timing bench: a busy machine only lowers the request count.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from hypothesis import HealthCheck, Phase, given, settings

from gateway.bench.harness import upstream
from gateway.bench.harness.fuzz_bodies import Case, cases
from gateway.bench.harness.fuzz_specs import CHAT, COMPLETION, ENGINE_ENDPOINTS, GATEWAY_ENDPOINTS, Endpoint
from gateway.bench.harness.fuzz_verdict import Answer, send, verdict
from gateway.bench.harness.report import table
from gateway.bench.harness.serve import serving
from native.model_gen import cached_model

TARGETS = ("gateway", "engine", "llama-server")


@dataclass
class Target:
    name: str
    client: httpx.Client
    endpoints: tuple[Endpoint, ...]
    model: str | None
    ours: bool = True
    sent: Counter[str] = field(default_factory=Counter)  # endpoint -> requests
    statuses: Counter[int] = field(default_factory=Counter)
    problems: list[tuple[Endpoint, Case, Answer, str]] = field(default_factory=list)


def _batch(target: Target, endpoint: Endpoint, examples: int, deadline: float) -> None:
    """One hypothesis run over `endpoint`: every answer tallied, every unacceptable one kept."""

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases(endpoint, target.model))
    def run(case: Case) -> None:
        if time.monotonic() >= deadline:
            return
        answer = send(target.client, endpoint, case)
        target.sent[endpoint.path] += 1
        target.statuses[answer.status] += 1
        problem = verdict(endpoint, answer)
        if problem:
            target.problems.append((endpoint, case, answer, problem))

    run()


def _still_serves(target: Target) -> str:
    """'' when the target answers a valid request after the fuzz, else what happened."""
    if target.name == "gateway":
        path, body = (
            CHAT.path,
            {"model": target.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
    else:
        path, body = COMPLETION.path, {"prompt": "hi", "n_predict": 2}
    try:
        r = target.client.post(path, json=body)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "" if r.status_code == 200 else f"{r.status_code}: {r.text[:300]}"


def _save(out: Path, target: Target) -> list[Path]:
    saved = []
    for i, (endpoint, case, answer, problem) in enumerate(target.problems):
        name = f"{target.name}-{i:03d}-{endpoint.path.strip('/').replace('/', '_')}"
        (out / f"{name}.body").write_bytes(case.body)
        meta = {
            "target": target.name,
            "path": endpoint.path,
            "case": case.describe(),
            "problem": problem,
            "status": answer.status,
            "answer": answer.text(4000),
            "replay": f"curl -sS -X POST URL{endpoint.path} -H 'content-type: application/json' "
            f"--data-binary @{name}.body",
        }
        (out / f"{name}.json").write_text(json.dumps(meta, indent=2))
        saved.append(out / f"{name}.json")
    return saved


def _report(targets: list[Target], elapsed: float) -> None:
    rows = [[f"{t.name} {path}", str(n)] for t in targets for path, n in sorted(t.sent.items())]
    total = sum(sum(t.sent.values()) for t in targets)
    print(table(["endpoint", "requests"], rows + [["all", str(total)]]))
    print(f"\n{total} requests in {elapsed:.0f} s ({total / max(elapsed, 1e-9):.1f}/s)\n")
    codes = sorted({c for t in targets for c in t.statuses})
    rows = [[str(c) if c else "none", *[str(t.statuses[c]) for t in targets]] for c in codes]
    print(table(["status", *[t.name for t in targets]], rows))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="slotkeeper bench fuzz",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument(
        "--target", action="append", choices=TARGETS, help="repeatable (default: gateway, engine)"
    )
    ap.add_argument("--batch", type=int, default=25, help="examples per hypothesis run")
    ap.add_argument("--models-dir", default=os.path.join(".bench", "models"))
    ap.add_argument(
        "--out",
        default=os.path.join(".bench", "fuzz"),
        help="failing requests and logs (a directory per run)",
    )
    args = ap.parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    names = args.target or ["gateway", "engine"]
    out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    model = os.path.abspath(cached_model(args.models_dir, "qwen35"))
    flags = upstream.Flags(model, slots=2, ctx=4096, threads=1)
    targets: list[Target] = []
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="bench-fuzz-") as tmp:
        for name in names:
            client = stack.enter_context(httpx.Client(timeout=120.0))
            if name == "gateway":
                serve = stack.enter_context(
                    serving(
                        out,
                        "serve",
                        [
                            *("--data-dir", str(Path(tmp) / "data")),
                            *("--model", model),
                            *("--slots", "2"),
                            *("--ctx", "2048"),
                            *("--log-level", "warning"),
                        ],
                    )
                )
                client.base_url = httpx.URL(serve.url)
                served = client.get("/v1/models").json()["data"][0]["id"]
                targets.append(Target(name, client, GATEWAY_ENDPOINTS, served))
            else:
                kind = "slotkeeper" if name == "engine" else "llama-server"
                server = upstream.start(kind, flags, out / f"{name}.log")
                stack.callback(server.stop)
                client.base_url = httpx.URL(server.url)
                targets.append(Target(name, client, ENGINE_ENDPOINTS, "tiny", ours=name == "engine"))
        print(f"fuzzing {', '.join(names)} for {args.minutes:g} min ...", flush=True)
        t0 = time.monotonic()
        deadline = t0 + args.minutes * 60
        while time.monotonic() < deadline:
            for target in targets:
                for endpoint in target.endpoints:
                    _batch(target, endpoint, args.batch, deadline)
        elapsed = time.monotonic() - t0
        after = {t.name: _still_serves(t) for t in targets}
    _report(targets, elapsed)
    failed = False
    for t in targets:
        for endpoint, case, _, problem in t.problems:
            print(f"\n{t.name} POST {endpoint.path} [{case.describe()}]\n  {problem}")
            print(f"  request: {case.body[:300]!r}")
        saved = _save(out, t)
        if saved:
            print(f"\n{t.name}: {len(saved)} requests saved under {out}/")
        if after[t.name]:
            print(f"\n{t.name} no longer serves a valid request: {after[t.name]}")
        failed = failed or (t.ours and bool(t.problems or after[t.name]))
    print("\nno 5xx" if not failed else "\nFAILED: 5xx or unacceptable answers (above)")
    return 1 if failed else 0

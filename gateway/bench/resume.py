"""`slotkeeper bench resume`: what the next turn of a long hybrid session costs, live and after a
save → restart → restore, side by side in one run (these machines are shared and noisy: compare
the ratios, not absolute times).

Rows: cold first turn; live next turn; restored next turn; restored divergent retry (inside the
saved prompt); restored identical prompt; and, as the upstream baseline, the restored next turn
with checkpoints off (what llama-server's /slots restore gives a hybrid model).

With `--upstream`, the same cases run over HTTP on our engine process and on upstream llama-server
(the `bench` extra installs it), same model, flags and token prompts, side by side with ratios; with
`--curve 1000,2000,...` the restored next turn's time to first token against the session's length,
for both, drawn to `--plot FILE.svg`. `--json FILE` writes every number.

With several lengths (`--tokens 32768,65536,131072`, or `--long` for one): long agent sessions
restored from the spill cache and from S3 on another node, with GB/s and memory
(:mod:`gateway.bench.long_sessions`).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import jinja2.sandbox

import native
from engine_pool.protocol.codec import Wire
from gateway.bench import long_sessions
from gateway.bench.harness import sidebyside
from gateway.bench.harness.prompts import CHUNK, SYSTEM
from gateway.bench.harness.upstream import Flags
from native.model_gen import cached_model

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class CaseRow:
    """One in-process case: prompt tokens evaluated, the engine's prompt ms, the wall ms (the
    restore included when restored)."""

    case: str
    prompt_n: int
    prompt_ms: float
    wall_ms: float


@dataclass(frozen=True)
class InProcess:
    prompt_tokens: int
    slot_file_bytes: int
    restored_tokens_equal_live: bool
    rows: list[CaseRow]


@dataclass(frozen=True)
class SideBySide:
    summary: sidebyside.Summary
    rows: dict[str, list[sidebyside.Row]]  # per server kind


@dataclass(frozen=True)
class ResumeReport(Wire):
    """What `--json` writes; the parts over HTTP only when they ran (absent otherwise)."""

    sparse = True
    bench: str
    model: str
    tokens: int
    in_process: InProcess
    side_by_side: SideBySide | None = None
    ttft_curve: dict[str, list[sidebyside.CurvePoint]] | None = None


def _render(template: str, messages: list[dict[str, str]]) -> str:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True)


def _engine(model: str, args: argparse.Namespace, max_checkpoints: int = 32) -> native.Engine:
    return native.Engine(
        native.EngineConfig(
            model,
            n_slots=1,
            n_ctx=args.ctx,
            n_batch=512,
            n_ubatch=512,
            n_threads=args.threads,
            checkpoint_interval=2048,
            max_checkpoints=max_checkpoints,
        )
    )


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="slotkeeper bench resume", description=__doc__)
    ap.add_argument("--model", help="GGUF model (default: the generated qwen35 bench model)")
    ap.add_argument("--models-dir", default=os.path.join(".bench", "models"))
    ap.add_argument(
        "--tokens",
        type=_lengths,
        default=[5000],
        help="approximate prompt length; several, comma-separated: the long-session bench "
        "(gateway.bench.long_sessions) at each",
    )
    ap.add_argument("--long", action="store_true", help="the long-session bench even for one length")
    ap.add_argument("--turn-tokens", type=int, default=4096, help="long sessions: tokens of each tool output")
    ap.add_argument("--no-s3", action="store_true", help="long sessions: leave the S3 restore out")
    ap.add_argument("--repeat", type=int, default=3, help="long sessions: restores of each kind (medians)")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--n-predict", type=int, default=16)
    ap.add_argument("--upstream", action="store_true", help="also run llama-server side by side (over HTTP)")
    ap.add_argument("--curve", help="session lengths for the restored-TTFT curve, comma-separated")
    ap.add_argument("--plot", help="draw the curve to this SVG file")
    ap.add_argument("--workdir", help="logs and slot files (default: a temporary directory)")
    ap.add_argument("--json", help="also write the results here as JSON")
    args = ap.parse_args(argv)
    model = args.model or cached_model(args.models_dir, "qwen35", size="bench")
    if args.long or len(args.tokens) > 1:
        return _long(model, args)
    args.tokens = args.tokens[0]
    rc, in_process = _in_process(model, args)
    side: SideBySide | None = None
    curve: dict[str, list[sidebyside.CurvePoint]] | None = None
    if args.upstream or args.curve:
        with tempfile.TemporaryDirectory(prefix="bench-resume-") as tmp:
            workdir = Path(args.workdir or tmp)
            workdir.mkdir(parents=True, exist_ok=True)
            side, curve = _over_http(model, args, workdir)
    report = ResumeReport("resume", os.path.basename(model), args.tokens, in_process, side, curve)
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2))
    return rc


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: token counts, comma-separated") from None
    if not lengths or min(lengths) < 64:
        raise argparse.ArgumentTypeError(f"{text!r}: each length at least 64 tokens")
    return lengths


@dataclass(frozen=True)
class LongReport(Wire):
    bench: str
    model: str
    lengths: list[long_sessions.LengthReport]


def _long(model: str, args: argparse.Namespace) -> int:
    reports = long_sessions.run(model, args, args.tokens)
    if args.json:
        report = LongReport("resume-long", os.path.basename(model), reports)
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2))
    return 0 if all(r.same_tokens for length in reports for r in length.restores) else 1


def _in_process(model: str, args: argparse.Namespace) -> tuple[int, InProcess]:
    eng = _engine(model, args)
    tmpl = eng.model.chat_template or CHATML
    user = ""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    while len(eng.tokenize(_render(tmpl, msgs))) < args.tokens:
        user += CHUNK
        msgs[1]["content"] = "Review this code:\n" + user
    prompt1 = eng.tokenize(_render(tmpl, msgs))
    hints = [len(eng.tokenize(_render(tmpl, msgs[:1]).removesuffix("<|im_start|>assistant\n")))]
    print(
        f"model {eng.model.description} ({eng.model.n_params / 1e6:.0f}M params, {eng.model.arch}); "
        f"prompt {len(prompt1)} tokens"
    )

    rows: list[tuple[str, int, float, float]] = []  # name, prompt_n, prompt_ms, wall_ms incl. restore

    def run(name: str, engine: native.Engine, prompt: list[int], extra_ms: float = 0.0, **kw: object):
        t0 = time.perf_counter()
        done = engine.generate(0, long_sessions.greedy_request(prompt, args.n_predict, **kw))  # type: ignore[arg-type]
        wall = (time.perf_counter() - t0) * 1000 + extra_ms
        assert done.timings is not None
        rows.append((name, done.timings.prompt_n, done.timings.prompt_ms, wall))
        return done

    turn1 = run("cold first turn", eng, prompt1, hints=hints)
    msgs2 = msgs + [{"role": "assistant", "content": turn1.text}, {"role": "user", "content": "Fix the bug."}]
    prompt2 = eng.tokenize(_render(tmpl, msgs2))
    divergent = prompt1[: len(prompt1) * 7 // 10] + eng.tokenize("Actually, review only the tests.", False)

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "session.slot")
        saved = eng.save_slot(0, path)
        live = run("live next turn", eng, prompt2)
        eng.close()

        def restored(name: str, prompt: list[int], max_checkpoints: int = 32) -> native.Completion:
            fresh = _engine(model, args, max_checkpoints)  # a restart
            try:
                t0 = time.perf_counter()
                fresh.restore_slot(0, path)
                return run(name, fresh, prompt, extra_ms=(time.perf_counter() - t0) * 1000)
            finally:
                fresh.close()

        t0 = time.perf_counter()
        probe = _engine(model, args)
        probe.restore_slot(0, path)
        restore_ms = (time.perf_counter() - t0) * 1000
        probe.close()
        back = restored("restored next turn", prompt2)
        restored("restored divergent retry", divergent)
        restored("restored identical prompt", prompt1)
        restored("restored next turn, no checkpoints (upstream)", prompt2, max_checkpoints=0)

    print(
        f"slot file: {saved.n_bytes / 2**20:.1f} MiB, {saved.n_checkpoints} checkpoints, "
        f"save {saved.ms:.0f} ms, engine start + restore {restore_ms:.0f} ms"
    )
    print(f"{'case':48} {'prompt_n':>8} {'prompt ms':>10} {'wall ms':>9}")
    for name, n, pms, wall in rows:
        print(f"{name:48} {n:8d} {pms:10.0f} {wall:9.0f}")
    same = back.tokens == live.tokens
    print(
        f"restored/live next turn: prompt_n {rows[2][1]}/{rows[1][1]}, "
        f"prompt ms ratio {rows[2][2] / max(rows[1][2], 1e-9):.2f}, wall incl. restore ratio "
        f"{rows[2][3] / max(rows[1][3], 1e-9):.2f}; tokens identical: {same}"
    )
    cases = [CaseRow(*r) for r in rows]
    return (0 if same else 1), InProcess(len(prompt1), saved.n_bytes, same, cases)


def _conversation(eng: native.Engine, tmpl: str, tokens: int) -> list[dict[str, str]]:
    """The bench conversation (system + code to review) grown to about `tokens` tokens."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Review this code:\n"}]
    per_chunk = len(eng.tokenize(CHUNK, False))
    while (n := len(eng.tokenize(_render(tmpl, msgs)))) < tokens:
        msgs[1]["content"] += CHUNK * max(1, (tokens - n) // per_chunk)
    return msgs


def _over_http(
    model: str, args: argparse.Namespace, workdir: Path
) -> tuple[SideBySide | None, dict[str, list[sidebyside.CurvePoint]] | None]:
    """Our engine process and llama-server on the same model, flags and conversations: the side by
    side rows (with `--upstream`) and the TTFT curve (with `--curve`)."""
    tokenizer = native.Engine(native.EngineConfig(model, n_slots=1, n_ctx=512))  # vocab + template only
    tmpl = tokenizer.model.chat_template or CHATML
    first = _conversation(tokenizer, tmpl, args.tokens)
    content = first[1]["content"]
    divergent = [
        first[0],
        {"role": "user", "content": content[: len(content) * 7 // 10] + "\nReview only the tests."},
    ]
    lengths = [int(n) for n in args.curve.split(",")] if args.curve else []
    builds = {n: _conversation(tokenizer, tmpl, n) for n in lengths}
    tokenizer.close()
    flags = Flags(model, slots=1, ctx=args.ctx, threads=args.threads)
    follow_up = "Fix the bug."
    side: SideBySide | None = None
    curve: dict[str, list[sidebyside.CurvePoint]] | None = None
    if args.upstream:
        print(
            f"\n== over HTTP (chat completions), side by side: ~{args.tokens}-token conversation, "
            f"{args.n_predict} tokens per answer =="
        )
        rows = {
            k: sidebyside.resume_rows(k, flags, first, follow_up, divergent, args.n_predict, workdir)
            for k in sidebyside.KINDS
        }
        side = SideBySide(sidebyside.print_side_by_side(rows), rows)
    if lengths:
        print("\n== restored next turn: time to first token against the session's length ==")
        kinds = sidebyside.KINDS if args.upstream else ("slotkeeper",)
        curve = sidebyside.ttft_curve(kinds, flags, lengths, builds.__getitem__, follow_up, workdir)
        if args.plot:
            sidebyside.plot(curve, Path(args.plot), f"{os.path.basename(model)}: next turn after a restart")
            print(f"plot: {args.plot}")
    return side, curve

"""Resume costs of our engine and upstream llama-server, side by side, over the same HTTP API.

Both servers get the same model, flags and conversations through `/v1/chat/completions` (greedy,
prompt cache on, one slot) — as agents call them: each renders the GGUF's chat template, so the next
turn's prompt re-renders the history the way the template does (Qwen3.5 drops the reasoning block of
past turns, so the next prompt leaves the saved one a few tokens before its end). Cases: cold first
turn; live next turn; and after a save → restart (a new process) → restore: the next turn, a
divergent retry inside the saved prompt, the identical conversation. Each row has the prompt tokens
evaluated (`prompt_n`), the engine's prompt ms, and the wall ms of restore + completion as a client
sees them. `ttft_curve` measures the restored next turn's time to first token against the
session's length, for the plot in docs/benchmarks.md.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from gateway.bench.harness.upstream import Flags, Server, start

KINDS = ("slotkeeper", "llama-server")


Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Row:
    case: str
    prompt_n: int
    prompt_ms: float
    wall_ms: float  # restore (when restored) + the completion, as the client saw them
    content: str


@dataclass(frozen=True)
class Summary:
    """Ours restored against ours live, and llama-server's restored next turn against ours."""

    restored_over_live_ours: float
    upstream_restored_over_ours: float
    restored_answer_equal_live: bool


@dataclass(frozen=True)
class CurvePoint:
    """The restored next turn of a session of `tokens` tokens (the cold turn's prompt_n)."""

    tokens: float
    ttft_ms: float
    prompt_n: int


def _row(case: str, srv: Server, messages: Messages, n_predict: int, restore_ms: float = 0.0) -> Row:
    t0 = time.perf_counter()
    out = srv.chat(messages, n_predict)
    wall = (time.perf_counter() - t0) * 1000 + restore_ms
    t = out.timed()
    return Row(case, t.prompt_n, t.prompt_ms, wall, out.content)


def _restored(kind: str, flags: Flags, log: Path, case: str, prompt: Messages, n_predict: int) -> Row:
    srv = start(kind, flags, log)  # a restart: a new process with nothing in its slot
    try:
        t0 = time.perf_counter()
        srv.slot("restore", 0, "session.slot")
        return _row(case, srv, prompt, n_predict, (time.perf_counter() - t0) * 1000)
    finally:
        srv.stop()


def resume_rows(
    kind: str,
    flags: Flags,
    first: Messages,
    follow_up: str,
    divergent: Messages,
    n_predict: int,
    workdir: Path,
) -> list[Row]:
    """The five cases on one kind of server. The next turn is the first conversation, the
    server's own answer, and `follow_up` as a new user message."""
    slot_dir = workdir / f"slots-{kind}"
    slot_dir.mkdir(parents=True, exist_ok=True)
    flags = Flags(**{**asdict(flags), "slot_dir": str(slot_dir)})
    log = workdir / f"{kind}.log"
    srv = start(kind, flags, log)
    try:
        cold = _row("cold first turn", srv, first, n_predict)
        nxt: Messages = [
            *first,
            {"role": "assistant", "content": cold.content},
            {"role": "user", "content": follow_up},
        ]
        srv.slot("save", 0, "session.slot")
        live = _row("live next turn", srv, nxt, n_predict)
    finally:
        srv.stop()
    return [
        cold,
        live,
        _restored(kind, flags, log, "restored next turn", nxt, n_predict),
        _restored(kind, flags, log, "restored divergent retry", divergent, n_predict),
        _restored(kind, flags, log, "restored identical prompt", first, n_predict),
    ]


def print_side_by_side(rows: dict[str, list[Row]]) -> Summary:
    ours, up = rows["slotkeeper"], rows["llama-server"]
    print(
        f"\n{'case':28} {'prompt_n ours':>13} {'llama-srv':>9} {'wall ms ours':>12} {'llama-srv':>10} "
        f"{'llama-srv/ours':>14}"
    )
    for a, b in zip(ours, up, strict=True):
        print(
            f"{a.case:28} {a.prompt_n:13d} {b.prompt_n:9d} {a.wall_ms:12.0f} {b.wall_ms:10.0f} "
            f"{b.wall_ms / max(a.wall_ms, 1e-9):14.1f}"
        )
    live, back = ours[1], ours[2]
    summary = Summary(
        restored_over_live_ours=back.wall_ms / max(live.wall_ms, 1e-9),
        upstream_restored_over_ours=up[2].wall_ms / max(back.wall_ms, 1e-9),
        restored_answer_equal_live=back.content == live.content,
    )
    print(
        f"ours: restored next turn {back.wall_ms:.0f} ms (restore included) vs live {live.wall_ms:.0f} ms "
        "= "
        f"{summary.restored_over_live_ours:.2f}x; llama-server's restored next turn is "
        f"{summary.upstream_restored_over_ours:.1f}x ours; restored answer == live answer: "
        f"{summary.restored_answer_equal_live}"
    )
    return summary


def ttft_curve(
    kinds: tuple[str, ...],
    flags: Flags,
    lengths: list[int],
    build: Callable[[int], Messages],
    follow_up: str,
    workdir: Path,
) -> dict[str, list[CurvePoint]]:
    """Per kind and session length: the restored next turn's time to first token (restore + a
    one-token answer), after a cold turn of that length was saved and the server restarted.
    `build(length)` returns the first conversation."""
    curve: dict[str, list[CurvePoint]] = {k: [] for k in kinds}
    for length in lengths:
        first = build(length)
        for kind in kinds:
            with tempfile.TemporaryDirectory(dir=workdir) as tmp:
                f = Flags(**{**asdict(flags), "slot_dir": tmp, "ctx": max(flags.ctx, 2 * length + 512)})
                log = workdir / f"curve-{kind}.log"
                srv = start(kind, f, log)
                try:
                    cold = _row("cold", srv, first, 4)
                    srv.slot("save", 0, "session.slot")
                finally:
                    srv.stop()
                nxt: Messages = [
                    *first,
                    {"role": "assistant", "content": cold.content},
                    {"role": "user", "content": follow_up},
                ]
                row = _restored(kind, f, log, "restored next turn", nxt, 1)
            curve[kind].append(CurvePoint(float(cold.prompt_n), row.wall_ms, row.prompt_n))
            print(
                f"  {kind:12} {cold.prompt_n:6d}-token session: restored next turn's TTFT "
                f"{row.wall_ms:8.0f} ms (prompt_n {row.prompt_n})",
                flush=True,
            )
    return curve


def plot(curve: dict[str, list[CurvePoint]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for kind, points in curve.items():
        ax.plot(
            [p.tokens for p in points],
            [p.ttft_ms / 1000 for p in points],
            marker="o",
            label="Slotkeeper (restored from its slot file)"
            if kind == "slotkeeper"
            else "llama-server (/slots restore)",
        )
    ax.set_xlabel("session length (tokens)")
    ax.set_ylabel("time to first token of the restored next turn (s)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="svg")
    plt.close(fig)

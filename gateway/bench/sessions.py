"""`slotkeeper bench sessions`: agent sessions taking turns on fewer slots than there are sessions,
side by side with upstream llama-server in one run.

Setup: the bench hybrid (or `--model`); a shared system prompt of about `--system-tokens` tokens
with `--tools` tools; `--sessions` sessions on `--slots` slots (more sessions than slots), each
opening with a task of about `--task-tokens` tokens of its own (a source file pasted into the chat,
as agents send one); greedy answers of `--max-tokens` tokens. Round 1 is every session's first
turn, one session after another; every later round (up to `--rounds`) sends each session, in the
same order, a short next message with its whole history and the answers it was given. Ours runs
through `slotkeeper serve` with `X-Session-Id` on every request, and each turn is sent once the one
before it has been saved (agents spend seconds running tools between turns; a save takes less);
llama-server is called as an agent calls it, without `id_slot` (it picks the slot by the prompt and
keeps evicted prompts in its host-memory cache at its default `--cache-ram`).

Then, ours only, a live turn for reference: the last session's next `--live-turns` messages one
after another, its state still in its slot.

Per round and server: the prompt tokens evaluated (the sum of `timings.prompt_n`), the time to
answer (median, p90), the server's own time evaluating the prompt (`timings.prompt_ms`, median: what
of the time to answer is the prefill itself) and the time spent answering the round; the same for
round 1's sessions after the first (new sessions that may start from the shared prefix) and for the
whole run. Goals:
from round 2 on, ours at most 1.2x a live turn's median time, and at least 10x less than
llama-server's. The machines are shared and noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from engine_pool.protocol.chat_types import ChatTool
from engine_pool.protocol.codec import Wire
from gateway.bench.harness.serve import serving
from gateway.bench.harness.upstream import Flags, start
from gateway.bench.prefix import (
    WORDS,
    Chat,
    cache_n,
    calibrate,
    count_tokens,
    generation,
    tools,
    user,
    wait_durable,
)
from native.model_gen import cached_model

LIVE_SLACK = 1.2  # rounds 2.. against a live turn
UPSTREAM_FACTOR = 10.0  # rounds 2.. against llama-server's


@dataclass(frozen=True)
class Turn:
    server: str
    round: int  # 1: the session's first turn; "live" turns are round 0
    session: int
    prompt_tokens: int
    prompt_n: int  # tokens evaluated
    ms: float  # time to answer
    prompt_ms: float  # the server's own time evaluating them (`timings.prompt_ms`)
    served: str  # how the gateway served it (llama-server: its cache_n)


@dataclass(frozen=True)
class Stats:
    """Turns of a round (or the whole run): prompt tokens evaluated and sent, times to answer."""

    turns: int
    evaluated: int
    prompt_tokens: int
    median_ms: float
    p90_ms: float
    answering_ms: float
    prompt_median_ms: float  # the server's own prompt time (`timings.prompt_ms`), median


# A server's rounds in the summary (its keys are the report's, spaces included).
ServerRounds = TypedDict(
    "ServerRounds",
    {
        "rounds": dict[str, Stats],  # round number -> its turns
        "round 1 after the first": Stats | None,  # new sessions that may start from the shared prefix
        "rounds 2..": Stats | None,  # None: one round only
        "whole run": Stats,
    },
)


@dataclass(frozen=True)
class SessionsReport(Wire):
    """What `--json` writes."""

    bench: str
    model: str
    sessions: int
    slots: int
    rounds: int
    max_tokens: int
    system_tokens: int
    task_lines: int
    turns: list[Turn]
    summary: dict[str, object]  # see `summary`


def task_text(session: int, lines: int) -> str:
    """A session's own task: a request about a source file of `lines` lines, pasted whole."""
    body = "\n".join(
        f"def {WORDS[(session + k) % len(WORDS)]}_{session}_{k}(x):  # {WORDS[(k * 3) % len(WORDS)]}\n"
        f"    return x + {k * 7 + session}"
        for k in range(lines)
    )
    return f"Session {session}: review this file and fix what fails.\n```python\n{body}\n```"


def next_message(round_no: int, session: int) -> str:
    return f"Round {round_no}, session {session}: the test still fails. Look at line {round_no * 3}."


def fit_task(chat: Chat, target: int) -> int:
    """The file length (lines) whose task is about `target` tokens beyond the shared prefix."""
    prefix = count_tokens(chat, "")
    per_line = max((count_tokens(chat, task_text(0, 20)) - prefix) / 20, 1.0)
    return max(1, round(target / per_line))


class Agent:
    """One session's conversation: its history, sent whole every turn."""

    def __init__(self, index: int, lines: int) -> None:
        self.index, self.session = index, f"agent-{index}"
        # the messages we write, and those answered, as they came (an agent sends them back)
        self.history: list[Mapping[str, object]] = [user(task_text(index, lines))]

    def turn(self, chat: Chat, server: str, round_no: int, max_tokens: int, session: bool) -> Turn:
        if round_no != 1:
            self.history.append(user(next_message(round_no, self.index)))
        out, ms, served = chat.ask(self.history, self.session if session else None, max_tokens)
        self.history.append(out.message)
        timings = out.timed()
        return Turn(
            server,
            round_no,
            self.index,
            out.prompt_tokens(),
            timings.prompt_n,
            ms,
            timings.prompt_ms,
            served or cache_n(timings),
        )


def ours(
    args: argparse.Namespace, model: str, tool_list: list[ChatTool], workdir: Path
) -> tuple[list[Turn], str, int]:
    """Our rounds and live turns, and the system prompt and file length they used."""
    flags = [
        *("--model", model),
        *("--slots", str(args.slots)),
        *("--ctx", str(args.ctx)),
        *("--data-dir", str(workdir / "data")),
        *("--log-level", "warning"),
    ]
    turns: list[Turn] = []
    with serving(workdir, "serve", flags) as serve:
        chat = Chat("slotkeeper", serve.url, "", tool_list)
        try:
            calibrate(chat, args.system_tokens)
            lines = fit_task(chat, args.task_tokens)
            agents = [Agent(i, lines) for i in range(args.sessions)]

            def turn(agent: Agent, round_no: int) -> Turn:
                before = generation(serve.url, agent.session)
                done = agent.turn(chat, "slotkeeper", round_no, args.max_tokens, session=True)
                wait_durable(serve.url, [agent.session], above=before)
                return done

            for round_no in range(1, args.rounds + 1):
                turns += [turn(agent, round_no) for agent in agents]
            turns += [turn(agents[-1], 0) for _ in range(args.live_turns)]
            return turns, chat.system, lines
        finally:
            chat.close()


def upstream(
    args: argparse.Namespace,
    model: str,
    system: str,
    tool_list: list[ChatTool],
    lines: int,
    workdir: Path,
) -> list[Turn]:
    srv = start(
        "llama-server",
        Flags(model, slots=args.slots, ctx=args.ctx * args.slots),
        workdir / "llama-server.log",
    )
    chat = Chat("llama-server", srv.url, system, tool_list)
    try:
        agents = [Agent(i, lines) for i in range(args.sessions)]
        return [
            agent.turn(chat, "llama-server", round_no, args.max_tokens, session=False)
            for round_no in range(1, args.rounds + 1)
            for agent in agents
        ]
    finally:
        chat.close()
        srv.stop()


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]


def stats(turns: list[Turn]) -> Stats:
    ms = [t.ms for t in turns]
    return Stats(
        turns=len(turns),
        evaluated=sum(t.prompt_n for t in turns),
        prompt_tokens=sum(t.prompt_tokens for t in turns),
        median_ms=round(statistics.median(ms), 1),
        p90_ms=round(p90(ms), 1),
        answering_ms=round(sum(ms), 1),
        prompt_median_ms=round(statistics.median(t.prompt_ms for t in turns), 1),
    )


def summary(turns: list[Turn], rounds: int) -> dict[str, object]:
    """The summary's JSON object: each server's `ServerRounds` under its name, the live turns'
    `Stats` ("live turn"), the ratios of rounds 2.. when there is what they compare, and the goals
    (name -> met, None: not measured)."""
    servers: dict[str, ServerRounds] = {}
    for server in ("slotkeeper", "llama-server"):
        mine = [t for t in turns if t.server == server and t.round >= 1]
        if not mine:
            continue
        per_round = {str(r): stats([t for t in mine if t.round == r]) for r in range(1, rounds + 1)}
        later = [t for t in mine if t.round >= 2]
        new = [t for t in mine if t.round == 1][1:]
        servers[server] = {
            "rounds": per_round,
            "round 1 after the first": stats(new) if new else None,
            "rounds 2..": stats(later) if later else None,
            "whole run": stats(mine),
        }
    out: dict[str, object] = dict(servers)
    live = [t for t in turns if t.round == 0]
    live_turn = stats(live) if live else None
    if live_turn:
        out["live turn"] = live_turn
    ours_later = servers["slotkeeper"]["rounds 2.."] if "slotkeeper" in servers else None
    theirs_later = servers["llama-server"]["rounds 2.."] if "llama-server" in servers else None
    goals: dict[str, bool | None] = {
        "rounds 2.. <= 1.2x a live turn": None,
        "rounds 2.. >= 10x llama-server": None,
    }
    if ours_later and live_turn:
        out["rounds 2.. / live turn"] = ratio = round(ours_later.median_ms / live_turn.median_ms, 2)
        goals["rounds 2.. <= 1.2x a live turn"] = ratio <= LIVE_SLACK
    if ours_later and theirs_later:
        out["llama-server / ours, rounds 2.."] = ratio = round(
            theirs_later.median_ms / ours_later.median_ms, 1
        )
        goals["rounds 2.. >= 10x llama-server"] = ratio >= UPSTREAM_FACTOR
    out["goals"] = goals
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="slotkeeper bench sessions", description=__doc__)
    ap.add_argument("--model", help="GGUF model (default: the generated qwen35 bench model)")
    ap.add_argument("--models-dir", default=os.path.join(".bench", "models"))
    ap.add_argument(
        "--system-tokens", type=int, default=2900, help="the shared system prompt and tools, about"
    )
    ap.add_argument("--tools", type=int, default=8, help="tools in the shared prefix")
    ap.add_argument("--task-tokens", type=int, default=2300, help="each session's own first message, about")
    ap.add_argument("--sessions", type=int, default=12, help="agent sessions")
    ap.add_argument("--slots", type=int, default=4, help="slots of each server (fewer than sessions)")
    ap.add_argument("--rounds", type=int, default=4, help="turns of each session")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens answered a turn (greedy)")
    ap.add_argument("--live-turns", type=int, default=3, help="live turns for reference (ours)")
    ap.add_argument("--ctx", type=int, default=8192, help="context per slot")
    ap.add_argument("--no-upstream", action="store_true", help="ours only")
    ap.add_argument("--workdir", help="logs and data (default: a temporary directory)")
    ap.add_argument("--json", help="also write every number here")
    args = ap.parse_args(argv)
    if args.sessions <= args.slots:
        ap.error("--sessions must be more than --slots: sessions take turns on the slots")
    if args.rounds < 2:
        ap.error("--rounds must be at least 2: round 1 is the sessions' first turns")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # (one line per request otherwise)
    model = os.path.abspath(args.model or cached_model(args.models_dir, "qwen35", size="bench"))
    tool_list = tools(args.tools)
    with tempfile.TemporaryDirectory(prefix="bench-sessions-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        turns, system, lines = ours(args, model, tool_list, workdir)
        if not args.no_upstream:
            turns += upstream(args, model, system, tool_list, lines, workdir)
    report = SessionsReport(
        bench="sessions",
        model=os.path.basename(model),
        sessions=args.sessions,
        slots=args.slots,
        rounds=args.rounds,
        max_tokens=args.max_tokens,
        system_tokens=args.system_tokens,
        task_lines=lines,
        turns=turns,
        summary=summary(turns, args.rounds),
    ).to_json()
    head = f"{'server':13} {'round':>5} {'#':>3} {'prompt':>7} {'prompt_n':>8} {'ms':>9}"
    print(f"{head} {'prompt_ms':>9}  served")
    for t in turns:
        line = f"{t.server:13} {t.round or 'live':>5} {t.session:3d} {t.prompt_tokens:7d} {t.prompt_n:8d}"
        print(f"{line} {t.ms:9.1f} {t.prompt_ms:9.1f}  {t.served}")
    print(json.dumps(report["summary"], indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0

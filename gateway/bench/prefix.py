"""`slotkeeper bench prefix`: new sessions that share a tenant's system prompt and tools, side by
side with upstream llama-server (its host prompt cache, `--cache-ram`, at its default) in one run.

Setup: the bench hybrid (or `--model`), a system prompt of about `--system-tokens` tokens with
`--tools` tools, `--sessions` new sessions with distinct first messages, `--slots` slots, chat
completions as agents send them (greedy, one token answered: its wall time is the time to first
token). Phases, ours through `slotkeeper serve` (gateway, node agent, engine; a new session per
`X-Session-Id`), llama-server without `id_slot` (it picks the slot):

1. live: the sessions one after another on a running server;
2. restart: SIGKILL, a new process, new sessions (llama-server keeps nothing in RAM across it; ours
   restores the shared prefix from storage);
3. second node (ours; needs `weed`, SeaweedFS): a `serve` process with a data directory of its own
   (no spill cache, its index rebuilt from the bucket) on the same S3 bucket.

Each of our sessions starts once the one before it has been saved (its after-turn save, which an
eviction of it would wait for: agents do not start sessions a few hundred milliseconds apart).

Every row: tokens the session evaluated (`prompt_n`), its prompt and the shared prefix's share of
it, the TTFT, how it was served. Then, for comparison, a resumed turn of the same length (an
existing session's next message) and the goals: each new session evaluates its own tokens plus at
most 64 template tokens in every phase; its TTFT at most 1.3x the resumed turn's; after the restart
at least 10x less TTFT than llama-server's. The machines are shared and noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from engine_pool.protocol.chat_types import ChatBody, ChatMessage, ChatTool
from engine_pool.protocol.codec import Wire
from gateway.bench.harness.answers import ChatAnswer, InputTokens, Timings, chat_answer
from gateway.bench.harness.serve import start_serve
from gateway.bench.harness.servers import CREDS, make_bucket, weed_mini
from gateway.bench.harness.upstream import Flags, start
from native.model_gen import cached_model

WORDS = tuple(
    "repository function test module error request session parser config handler build deploy"
    " review commit branch schema cache queue".split()
)
TASKS = (
    "fix the failing test in",
    "add logging to",
    "refactor",
    "document",
    "review the change to",
    "write a test for",
    "profile",
    "remove dead code from",
)
TEMPLATE_SLACK = 64  # tokens a new session may evaluate beyond its own message (the template's)


@dataclass(frozen=True)
class Row:
    server: str
    phase: str
    session: int
    prompt_tokens: int
    prompt_n: int
    ttft_ms: float
    served: str


@dataclass(frozen=True)
class Resumed:
    """A resumed turn of the last live session (its next message)."""

    prompt_n: int
    ttft_ms: float
    served: str


@dataclass(frozen=True)
class OursRun:
    """Our phases: the rows, the calibrated system prompt, the shared prefix's and a first message's
    own tokens, the resumed turns; `second_node` says why that phase was skipped (None: it ran)."""

    rows: list[Row]
    system: str
    prefix_tokens: int
    own_tokens: int
    resumed: list[Resumed]
    second_node: str | None


@dataclass(frozen=True)
class PhaseSummary:
    """One server's phase: its first session's and the median and max prompt_n and TTFT, and
    whether every session after the first evaluated its own tokens plus the template's alone."""

    first_prompt_n: int
    first_ttft_ms: float
    median_prompt_n: float
    max_prompt_n: int
    median_ttft_ms: float
    within_own_plus_64: bool


@dataclass(frozen=True, kw_only=True)
class PrefixReport(Wire):
    """What `--json` writes; `second_node` only when that phase was skipped (why)."""

    sparse = True
    bench: str
    model: str
    sessions: int
    slots: int
    prefix_tokens: int
    own_tokens: int
    resumed: list[Resumed]
    second_node: str | None = None
    rows: list[Row]
    summary: dict[str, object]  # see `summary`


def system_prompt(words: int) -> str:
    lines: list[str] = []
    n = 0
    while n < words:
        line = " ".join(WORDS[(n + i * 7) % len(WORDS)] for i in range(12))
        lines.append(f"Rule {len(lines) + 1}: always check the {line}.")
        n += 12
    return "You are a coding agent working in a large repository.\n" + "\n".join(lines)


def tools(count: int) -> list[ChatTool]:
    def word(n: int) -> str:
        return WORDS[n % len(WORDS)]

    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}_{word(i)}",
                "description": f"Operate on the {word(i)} of a file ({word(i * 5)}).",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": "the file"},
                        "lines": {"type": "array", "items": {"type": "integer"}},
                        "mode": {"type": "string", "enum": ["read", "write", "check"]},
                    },
                    "required": ["path"],
                },
            },
        }
        for i in range(count)
    ]


def first_message(phase: str, i: int) -> str:
    return f"[{phase} {i}] Please {TASKS[i % len(TASKS)]} src/{WORDS[i % len(WORDS)]}_{i}.py."


class Chat:
    """One server's chat completions endpoint, as an agent calls it."""

    def __init__(self, name: str, url: str, system: str, tool_list: list[ChatTool]) -> None:
        self.name, self.url = name, url
        self.system, self.tools = system, tool_list
        self.client = httpx.Client(timeout=3600)

    def ask(
        self, messages: Sequence[Mapping[str, object]], session: str | None = None, max_tokens: int = 1
    ) -> tuple[ChatAnswer, float, str]:
        """The answer, its wall time in ms (with one token answered: the time to first token) and how
        the gateway served it (empty for llama-server). `messages`: those we write, and the messages
        answered before, as they came."""
        body: ChatBody = {
            "messages": [{"role": "system", "content": self.system}, *messages],
            "tools": self.tools,
            "max_tokens": max_tokens,
            "temperature": 0,
            "top_k": 1,
            "model": "m",
        }
        headers = {"X-Session-Id": session} if session else {}
        t0 = time.perf_counter()
        resp = self.client.post(self.url + "/v1/chat/completions", json=body, headers=headers)
        wall = (time.perf_counter() - t0) * 1000
        if resp.status_code != 200:
            raise RuntimeError(f"{self.name}: HTTP {resp.status_code}: {resp.text[:400]}")
        return chat_answer(resp.json()), wall, resp.headers.get("x-slotkeeper-cache", "")

    def row(self, phase: str, i: int, session: str | None) -> Row:
        out, wall, served = self.ask([user(first_message(phase, i))], session)
        timings = out.timed()
        return Row(
            self.name, phase, i, out.prompt_tokens(), timings.prompt_n, wall, served or cache_n(timings)
        )

    def close(self) -> None:
        self.client.close()


def user(text: str) -> ChatMessage:
    return {"role": "user", "content": text}


def cache_n(timings: Timings) -> str:
    """How llama-server served a turn: the prompt tokens its cache gave."""
    return f"cache_n={'' if timings.cache_n is None else timings.cache_n}"


def count_tokens(chat: Chat, text: str) -> int:
    """The prompt's tokens for a first message `text`, as the engine renders it."""
    messages: list[ChatMessage] = [{"role": "system", "content": chat.system}, user(text)]
    body: ChatBody = {"model": "m", "messages": messages, "tools": chat.tools}
    resp = chat.client.post(chat.url + "/v1/chat/completions/input_tokens", json=body)
    return InputTokens.from_json(resp.json()).input_tokens


def calibrate(chat: Chat, target: int) -> None:
    """Grow or shrink the system prompt until the shared prefix is about `target` tokens."""
    words = max(12, target // 2)
    for _ in range(4):
        chat.system = system_prompt(words)
        got = count_tokens(chat, "")
        if abs(got - target) <= target // 50:
            return
        words = max(12, round(words * target / max(got, 1)))
    chat.system = system_prompt(words)


@contextmanager
def store(args: argparse.Namespace, workdir: Path) -> Iterator[list[str]]:
    """serve's store flags: a SeaweedFS bucket when `weed` is on PATH (phase 3 needs one), else the
    local store under each data directory."""
    if shutil.which("weed") is None or args.no_s3:
        yield []
        return
    (workdir / "weed").mkdir(exist_ok=True)
    with weed_mini(workdir / "weed") as endpoint:
        make_bucket(endpoint, "slots")
        yield ["--s3-endpoint", endpoint, "--s3-bucket", "slots"]


def ours(args: argparse.Namespace, model: str, tool_list: list[ChatTool], workdir: Path) -> OursRun:
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": CREDS["aws_access_key_id"],
        "AWS_SECRET_ACCESS_KEY": CREDS["aws_secret_access_key"],
    }
    rows: list[Row] = []
    second_node = None
    with store(args, workdir) as s3:

        def flags(data: str) -> list[str]:
            return [
                *("--model", model),
                *("--slots", str(args.slots)),
                *("--ctx", str(args.ctx)),
                *("--data-dir", str(workdir / data)),
                *("--log-level", "warning"),
                *s3,
            ]

        serve = start_serve(workdir, "serve-live", flags("node-a"), env)
        chat = Chat("slotkeeper", serve.url, "", tool_list)
        try:
            calibrate(chat, args.system_tokens)
            system = chat.system
            prefix_tokens = count_tokens(chat, "")
            own_tokens = count_tokens(chat, first_message("live", 0)) - prefix_tokens
            rows += sessions(chat, serve.url, "live", args.sessions)
            # Resumed turns: the last session's next three messages, one after another (each goes
            # on from the turn before it: a turn from an earlier point would start a branch).
            last = args.sessions - 1
            session = f"live-{last}"
            first = user(first_message("live", last))

            def turn(messages: list[Mapping[str, object]]) -> tuple[ChatAnswer, float, str]:
                # Each once the one before has been saved (as the new sessions are).
                before = generation(serve.url, session)
                out = chat.ask(messages, session)
                wait_durable(serve.url, [session], above=before)
                return out

            answer = turn([first])[0].message  # (identical: nothing evaluated)
            resumed: list[Resumed] = []
            history: list[Mapping[str, object]] = [first, answer]
            for k in range(3):
                history.append(user(first_message(f"next{k}", last)))
                out, wall, served = turn(history)
                history.append(out.message)
                resumed.append(Resumed(out.timed().prompt_n, wall, served))
        finally:
            chat.close()
            serve.kill()  # SIGKILL: nothing saved on the way out

        def phase(name: str, log: str, data: str) -> list[Row]:
            """New sessions on a new serve process (the one before was SIGKILLed)."""
            serve = start_serve(workdir, log, flags(data), env)
            chat = Chat("slotkeeper", serve.url, system, tool_list)
            try:
                return sessions(chat, serve.url, name, args.sessions)
            finally:
                chat.close()
                serve.kill()

        rows += phase("restart", "serve-restart", "node-a")
        if s3:
            rows += phase("second node", "serve-second-node", "node-b")
        else:
            second_node = "skipped: no SeaweedFS (weed) to share a bucket between two processes"
    return OursRun(rows, system, prefix_tokens, own_tokens, resumed, second_node)


def sessions(chat: Chat, url: str, phase: str, n: int) -> list[Row]:
    """`n` new sessions one after another, each once the one before has been saved (its after-turn
    save: what a SIGKILL may not lose, and what evicting it would wait for)."""
    out = []
    for i in range(n):
        session = f"{phase.replace(' ', '-')}-{i}"
        out.append(chat.row(phase, i, session))
        wait_durable(url, [session])
    return out


def generation(url: str, session: str) -> int:
    return int(httpx.get(f"{url}/v1/sessions/{session}", timeout=30).json().get("generation", 0))


def wait_durable(url: str, sessions: list[str], above: int = 0, timeout: float = 600) -> None:
    """Until every session's after-turn save is recorded past generation `above` (what a SIGKILL
    may not lose, and what a turn sent meanwhile would share the cores with)."""
    deadline = time.monotonic() + timeout
    for s in sessions:
        while generation(url, s) <= above:
            if time.monotonic() > deadline:
                raise RuntimeError(f"session {s} was never saved")
            time.sleep(0.1)


def upstream(
    args: argparse.Namespace, model: str, system: str, tool_list: list[ChatTool], workdir: Path
) -> list[Row]:
    flags = Flags(model, slots=args.slots, ctx=args.ctx * args.slots)
    rows: list[Row] = []
    for phase in ("live", "restart"):
        srv = start("llama-server", flags, workdir / f"llama-server-{phase}.log")
        chat = Chat("llama-server", srv.url, system, tool_list)
        try:
            rows += [chat.row(phase, i, None) for i in range(args.sessions)]
        finally:
            chat.close()
            srv.stop()
    return rows


def summary(rows: list[Row], own: int, resumed: list[Resumed]) -> dict[str, object]:
    """The summary's JSON object: a `PhaseSummary` under "SERVER / PHASE" for each phase that ran,
    `new_vs_resumed_ttft` and `restart_first_ttft_ratio` when there is what they compare, and the
    goals (name -> met)."""
    phases: dict[str, PhaseSummary] = {}
    for server in ("slotkeeper", "llama-server"):
        for phase in ("live", "restart", "second node"):
            got = [r for r in rows if (r.server, r.phase) == (server, phase)]
            if not got:
                continue
            # The first live session evaluates everything (nothing to share yet), and llama-server's
            # first one in each phase (it keeps nothing across a restart).
            later = got[1:] if server == "llama-server" or phase == "live" else got
            phases[f"{server} / {phase}"] = PhaseSummary(
                first_prompt_n=got[0].prompt_n,
                first_ttft_ms=round(got[0].ttft_ms, 1),
                median_prompt_n=statistics.median(r.prompt_n for r in got),
                max_prompt_n=max(r.prompt_n for r in got),
                median_ttft_ms=round(statistics.median(r.ttft_ms for r in got), 1),
                within_own_plus_64=all(r.prompt_n <= own + TEMPLATE_SLACK for r in later),
            )
    out: dict[str, object] = dict(phases)
    new_vs_resumed, restart_ratio = 99.0, 0.0  # (goals not met when there is nothing to compare)
    if resumed and "slotkeeper / live" in phases:
        resumed_ms = statistics.median(r.ttft_ms for r in resumed)
        new = [r.ttft_ms for r in rows if r.server == "slotkeeper" and r.phase == "live"][1:]
        new_ms = statistics.median(new) if new else resumed_ms
        out["new_vs_resumed_ttft"] = new_vs_resumed = round(new_ms / resumed_ms, 2)
    ours_first = next(
        (r for r in rows if (r.server, r.phase, r.session) == ("slotkeeper", "restart", 0)), None
    )
    theirs_first = next(
        (r for r in rows if (r.server, r.phase, r.session) == ("llama-server", "restart", 0)), None
    )
    if ours_first and theirs_first:
        out["restart_first_ttft_ratio"] = restart_ratio = round(theirs_first.ttft_ms / ours_first.ttft_ms, 1)
    out["goals"] = {
        "own tokens + <= 64 in every phase": all(
            v.within_own_plus_64 for k, v in phases.items() if k.startswith("slotkeeper")
        ),
        "new session TTFT <= 1.3x a resumed turn": new_vs_resumed <= 1.3,
        "after a restart >= 10x less TTFT than llama-server": restart_ratio >= 10,
    }
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="slotkeeper bench prefix", description=__doc__)
    ap.add_argument("--model", help="GGUF model (default: the generated qwen35 bench model)")
    ap.add_argument("--models-dir", default=os.path.join(".bench", "models"))
    ap.add_argument(
        "--system-tokens", type=int, default=8000, help="the shared prefix (system + tools), about"
    )
    ap.add_argument("--tools", type=int, default=20, help="tools in the shared prefix")
    ap.add_argument("--sessions", type=int, default=16, help="new sessions per phase")
    ap.add_argument("--slots", type=int, default=4, help="slots of each server")
    ap.add_argument("--ctx", type=int, default=10240, help="context per slot")
    ap.add_argument("--no-upstream", action="store_true", help="ours only")
    ap.add_argument("--no-s3", action="store_true", help="the local store (no second-node phase)")
    ap.add_argument("--workdir", help="logs and data (default: a temporary directory)")
    ap.add_argument("--json", help="also write every number here")
    args = ap.parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # (one line per request otherwise)
    model = os.path.abspath(args.model or cached_model(args.models_dir, "qwen35", size="bench"))
    tool_list = tools(args.tools)
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        run = ours(args, model, tool_list, workdir)
        theirs = [] if args.no_upstream else upstream(args, model, run.system, tool_list, workdir)
    rows = run.rows + theirs
    report = PrefixReport(
        bench="prefix",
        model=os.path.basename(model),
        sessions=args.sessions,
        slots=args.slots,
        prefix_tokens=run.prefix_tokens,
        own_tokens=run.own_tokens,
        resumed=run.resumed,
        second_node=run.second_node,
        rows=rows,
        summary=summary(rows, run.own_tokens, run.resumed),
    )
    written = report.to_json()
    print(f"{'server':13} {'phase':12} {'#':>3} {'prompt':>7} {'prompt_n':>8} {'ttft ms':>9}  served")
    for r in rows:
        line = f"{r.server:13} {r.phase:12} {r.session:3d} {r.prompt_tokens:7d} {r.prompt_n:8d}"
        print(f"{line} {r.ttft_ms:9.1f}  {r.served}")
    print(f"own tokens of a first message: {run.own_tokens}; resumed turns: {written['resumed']}")
    print(json.dumps(written["summary"], indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(written, indent=2))
    return 0

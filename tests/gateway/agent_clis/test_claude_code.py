"""Claude Code, the npm package as shipped, against `slotkeeper serve` (Anthropic Messages).

Recipe (docs/agents.md): `ANTHROPIC_BASE_URL` (the gateway), `ANTHROPIC_AUTH_TOKEN` (any key without
a tenants file), `ANTHROPIC_MODEL` pinned — Claude Code's default, Opus 4.8 with a 1M context,
names itself "(1M context)" in its first run's system prompt but not in a resumed one's, which
changes the prompt near its top — and `CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1` (no telemetry or
update checks; it runs offline). `CLAUDE_CODE_MAX_OUTPUT_TOKENS` keeps the tiny model's turns short.

What it sends: every request of the conversation carries its whole history, the session in
`x-claude-code-session-id`, `thinking: {type: adaptive}`, `context_management` (clear_thinking,
keep all), `output_config.effort`, and after the first user message a mid-conversation `system`
message (its agent and skill listings). A turn whose answer hits the output cap is continued by up
to three recovery calls ("Output token limit hit. Resume directly ..."), after which the run ends
with an error result — the tiny model always hits it, so a turn is four calls and `claude -p`
exits 1 with that message; the recovery messages are not kept in the transcript, so the next turn
resends the history without them (a branch from the turn's first call, at full reuse).

Main calls are the POST /v1/messages requests with the main agent's tools (the `Agent` tool among
them); the only side request in these runs is the CLI's `HEAD /` reachability probe.
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.agent_clis import CLAUDE, Ledger, installed, isolated_env, run
from support.recording_proxy import Exchange, RecordingProxy

from .conftest import OUTPUT_TOKENS, Workspace

pytestmark = pytest.mark.slow

MODEL = "claude-opus-4-8"
CAPPED = f"exceeded the {OUTPUT_TOKENS} output token maximum"  # the tiny model's every turn


def is_main(e: Exchange) -> bool:
    if e.method != "POST" or e.path != "/v1/messages" or not isinstance(e.body, dict):
        return False
    return "Agent" in {t.get("name") for t in e.body.get("tools") or []}


def claude_env(home: Path, proxy: RecordingProxy) -> dict[str, str]:
    return isolated_env(
        home,
        ANTHROPIC_BASE_URL=proxy.url,
        ANTHROPIC_AUTH_TOKEN="unused",
        ANTHROPIC_MODEL=MODEL,
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(OUTPUT_TOKENS),
    )


def served(proc: subprocess.CompletedProcess[str]) -> bool:
    """A run whose every call was served: exit 0, or exit 1 with only the output-cap error."""
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return False
    return proc.returncode == 0 or (proc.returncode == 1 and CAPPED in str(result.get("result")))


def claude_p(claude: Path, project: Path, env: dict[str, str], prompt: str, *args: str) -> dict[str, Any]:
    """`claude -p PROMPT ARGS --output-format json`: its result object."""
    argv = [str(claude), "-p", prompt, *args, "--output-format", "json"]
    proc = run(argv, project, env, served=served)
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


class StreamJsonSession:
    """`claude -p --input-format stream-json`: one process, one session, a user turn at a time."""

    def __init__(self, claude: Path, project: Path, env: dict[str, str]) -> None:
        argv = [str(claude), "-p", "--input-format", "stream-json", "--output-format", "stream-json"]
        self.proc = subprocess.Popen(
            [*argv, "--verbose"],
            cwd=project,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def turn(self, text: str, timeout: float = 300) -> dict[str, Any]:
        """Sends one user message; the turn's result event."""
        assert self.proc.stdin is not None
        message = {"type": "user", "message": {"role": "user", "content": text}}
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line, f"claude exited {self.proc.poll()} before the turn's result"
            event = json.loads(line)
            if event.get("type") == "result":
                return dict(event)

    def close(self) -> None:
        """Ends its input, so it exits; killed if it does not within 30 s."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.reader.join(10)
        self.proc.stdout.close()


def _answered(result: dict[str, Any]) -> None:
    assert not result.get("is_error") or CAPPED in str(result.get("result")), result


def test_turns_resume_new_session_and_fork_read_their_prompts_from_cache(
    gateway: RecordingProxy, workspace: Workspace
) -> None:
    project = workspace.project
    claude = installed(CLAUDE)
    env = claude_env(workspace.home, gateway)
    ledger = Ledger(is_main)

    # Three turns of one session, in one process.
    session = StreamJsonSession(claude, project, env)
    previous: Exchange | None = None
    try:
        for n in (1, 2, 3):
            mark = gateway.mark()
            result = session.turn(f"Turn {n}: list the files.")
            _answered(result)
            calls = ledger.add(f"turn {n}", gateway.exchanges(after=mark))
            if previous is not None:
                ledger.check(calls, previous)
            previous = calls[-1]
            sid = result["session_id"]
    finally:
        session.close()
    assert {c.headers.get("x-claude-code-session-id") for _, c in ledger.rows} == {sid}

    # The session resumed by a new process.
    mark = gateway.mark()
    _answered(claude_p(claude, project, env, "Resumed: run the tests.", "--resume", sid))
    resumed = ledger.add("resume", gateway.exchanges(after=mark))
    ledger.check(resumed, previous)
    assert {c.headers.get("x-claude-code-session-id") for c in resumed} == {sid}

    # A new session in the same project: system prompt and tools from the first one.
    mark = gateway.mark()
    fresh = claude_p(claude, project, env, "A new task: read the README.")
    assert fresh["session_id"] != sid
    ledger.check(ledger.add("new session", gateway.exchanges(after=mark)), None)

    # A fork of the resumed session: a new session id, the parent's history.
    mark = gateway.mark()
    fork = claude_p(claude, project, env, "Forked: try another way.", "--resume", sid, "--fork-session")
    assert fork["session_id"] not in (sid, fresh["session_id"])
    forked = ledger.add("fork", gateway.exchanges(after=mark))
    assert {c.headers.get("x-claude-code-session-id") for c in forked} == {fork["session_id"]}
    ledger.check(forked, resumed[-1])
    print(f"\nClaude Code {CLAUDE.version}, main calls:\n{ledger}")


def test_compact_reads_the_whole_session_from_cache(gateway: RecordingProxy, workspace: Workspace) -> None:
    """`claude -p /compact --resume ID`: the compaction request is the session's whole history
    plus the summary instruction, with the same system prompt and tools, so it reads the session's
    prompt from cache. The tiny model's summary ends by chance: when it hits the output cap, the
    compaction ends with an error result; when it ends before, the compacted session's next turn —
    the summary instead of the history, under the same session id — reads its system prompt and
    tools from cache (a branch of the session: gateway.turn.branch)."""
    project = workspace.project
    claude = installed(CLAUDE)
    env = claude_env(workspace.home, gateway)
    ledger = Ledger(is_main)
    mark = gateway.mark()
    sid = claude_p(claude, project, env, "Read the README.")["session_id"]
    before = ledger.add("session", gateway.exchanges(after=mark))
    mark = gateway.mark()
    compacted = claude_p(claude, project, env, "/compact", "--resume", sid)
    calls = ledger.add("compact", gateway.exchanges(after=mark))
    summary = calls[0].body["messages"][-1]
    assert "summary of the conversation" in json.dumps(summary), summary
    assert calls[0].body["tools"] == before[0].body["tools"]
    ledger.check(calls, before[-1])
    if compacted.get("is_error"):
        assert CAPPED in str(compacted.get("result")), compacted
    else:
        mark = gateway.mark()
        _answered(claude_p(claude, project, env, "After the summary: update the changelog.", "--resume", sid))
        after = ledger.add("after /compact", gateway.exchanges(after=mark))
        assert "summary of the conversation" not in json.dumps(after[0].body["messages"])  # compacted
        assert after[0].status == 200 and after[0].answer_headers.get("x-slotkeeper-branch-of")
        # Its system prompt and tools (what a one-word conversation under them counts) from cache.
        first = after[0].body
        probe = {k: first[k] for k in ("model", "system", "tools")}
        counted = httpx.post(
            gateway.url + "/v1/messages/count_tokens",
            json={**probe, "messages": [{"role": "user", "content": "x"}]},
            timeout=60,
        )
        assert counted.status_code == 200, counted.text
        assert (after[0].cached or 0) >= 0.98 * counted.json()["input_tokens"], (after[0], counted.json())
    print(f"\nClaude Code {CLAUDE.version}, /compact:\n{ledger}")

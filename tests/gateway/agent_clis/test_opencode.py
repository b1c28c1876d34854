"""OpenCode, the npm package as shipped, against `slotkeeper serve` (Chat Completions).

Recipe (docs/agents.md): an `opencode.json` in the project naming the gateway as an
`@ai-sdk/openai-compatible` provider, and `opencode run -m slotkeeper/qwen35`; OpenCode takes its
project from the working directory. The model's `limit.output` caps `max_tokens` (the tiny model's
turns stay short).

What it sends: each conversation's requests carry its history, `stream_options.include_usage`, and
the OpenCode session id as `x-session-id` (and `x-session-affinity`), also on its side request.
Main calls are the requests that offer the agent's tools; the side request is the title generator
(system "You are a title generator", no tools) on a session's first run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.agent_clis import OPENCODE, Ledger, installed, isolated_env, run
from support.recording_proxy import Exchange, RecordingProxy

from .conftest import OUTPUT_TOKENS, Workspace

pytestmark = pytest.mark.slow

MODEL = "slotkeeper/qwen35"


def is_main(e: Exchange) -> bool:
    body = e.body if isinstance(e.body, dict) else {}
    return e.method == "POST" and e.path == "/v1/chat/completions" and bool(body.get("tools"))


def opencode_config(url: str) -> dict[str, object]:
    """The project's opencode.json: the gateway as a provider, its model capped at OUTPUT_TOKENS."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "slotkeeper": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "Slotkeeper",
                "options": {"baseURL": f"{url}/v1", "apiKey": "unused"},
                "models": {
                    "qwen35": {"name": "qwen35", "limit": {"context": 131072, "output": OUTPUT_TOKENS}}
                },
            }
        },
    }


def opencode_run(opencode: Path, project: Path, env: dict[str, str], prompt: str, *args: str) -> str:
    """`opencode run -m slotkeeper/qwen35 ARGS PROMPT --format json`: the session it ran in."""
    proc = run([str(opencode), "run", "-m", MODEL, *args, "--format", "json", prompt], project, env)
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    sessions = {e["sessionID"] for e in events if "sessionID" in e}
    assert len(sessions) == 1, proc.stdout[-3000:]
    assert not [e for e in events if e.get("type") == "error"], proc.stdout[-3000:]
    return sessions.pop()


def test_runs_continue_and_a_new_session_read_their_prompts_from_cache(
    gateway: RecordingProxy, workspace: Workspace
) -> None:
    project = workspace.project
    opencode = installed(OPENCODE)
    (project / "opencode.json").write_text(json.dumps(opencode_config(gateway.url), indent=2))
    env = isolated_env(workspace.home, PWD=str(project))
    ledger = Ledger(is_main)

    mark = gateway.mark()
    sid = opencode_run(opencode, project, env, "Turn 1: list the files.")
    first = gateway.exchanges(after=mark)
    titles = [e for e in first if e.path == "/v1/chat/completions" and not is_main(e)]
    assert titles and all("title generator" in json.dumps(e.body["messages"][0]) for e in titles), first
    previous = ledger.add("turn 1", first)[-1]

    for scenario, args in (
        ("turn 2 (--continue)", ["--continue"]),
        ("turn 3 (--session)", ["--session", sid]),
    ):
        mark = gateway.mark()
        assert opencode_run(opencode, project, env, f"{scenario}: run the tests.", *args) == sid
        calls = ledger.add(scenario, gateway.exchanges(after=mark))
        ledger.check(calls, previous)
        previous = calls[-1]

    mark = gateway.mark()
    assert opencode_run(opencode, project, env, "A new task: read the README.") != sid
    ledger.check(ledger.add("new session", gateway.exchanges(after=mark)), None)
    print(f"\nOpenCode {OPENCODE.version}, main calls:\n{ledger}")

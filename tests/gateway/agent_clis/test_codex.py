"""Codex, the npm package as shipped, against `slotkeeper serve` (the Responses API).

Recipe (docs/agents.md): `$CODEX_HOME/config.toml` naming the gateway as a model provider with
`wire_api = "responses"` and the key's variable in `env_key`; `codex exec` for a new session,
`codex exec resume --last` (or `resume ID`) to continue the newest (or a named) one. Codex sends
no output cap: serve's `--default-max-tokens` keeps the tiny model's turns short.

What it sends (0.171): function tools, a `namespace` tool grouping more, a hosted `web_search`
tool, `store: false` with `include: ["reasoning.encrypted_content"]`, `prompt_cache_key` and
`client_metadata` (session, thread and turn ids), the session in `session-id` / `thread-id` headers,
and `developer` / `user` input items carrying `id`s; every request resends the whole history.
Main calls are the POST /v1/responses requests that offer tools.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support.agent_clis import CODEX, Ledger, installed, isolated_env, run
from support.recording_proxy import Exchange, RecordingProxy

from .conftest import Workspace

pytestmark = pytest.mark.slow

CAPPED = "Incomplete response returned, reason: max_output_tokens"  # the tiny model's every turn
CONFIG = """\
model = "qwen35"
model_provider = "slotkeeper"

[model_providers.slotkeeper]
name = "Slotkeeper"
base_url = "{url}/v1"
wire_api = "responses"
env_key = "SLOTKEEPER_API_KEY"
"""


def is_main(e: Exchange) -> bool:
    body = e.body if isinstance(e.body, dict) else {}
    return e.method == "POST" and e.path == "/v1/responses" and bool(body.get("tools"))


def _events(proc: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def served(proc: subprocess.CompletedProcess[str]) -> bool:
    """A run whose every call was served: exit 0, or exit 1 whose only failure is the answer
    cut at the output cap (an `incomplete` response, which Codex counts as a failed turn)."""
    failures = [e for e in _events(proc) if e.get("type") in ("error", "turn.failed")]
    messages = {e.get("message") or e.get("error", {}).get("message") for e in failures}
    return proc.returncode == 0 and not failures or proc.returncode == 1 and messages == {CAPPED}


def codex_exec(codex: Path, project: Path, env: dict[str, str], *args: str) -> str:
    """`codex exec --json --skip-git-repo-check ARGS`: the session (thread) it ran in."""
    proc = run([str(codex), "exec", "--json", "--skip-git-repo-check", *args], project, env, served=served)
    threads = {e["thread_id"] for e in _events(proc) if e.get("type") == "thread.started"}
    assert len(threads) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    return threads.pop()


def test_exec_resume_and_a_new_session_read_their_prompts_from_cache(
    gateway: RecordingProxy, workspace: Workspace
) -> None:
    project = workspace.project
    codex = installed(CODEX)
    home = workspace.home
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True)
    (codex_home / "config.toml").write_text(CONFIG.format(url=gateway.url))
    env = isolated_env(home, CODEX_HOME=str(codex_home), SLOTKEEPER_API_KEY="unused")
    ledger = Ledger(is_main)

    mark = gateway.mark()
    sid = codex_exec(codex, project, env, "Turn 1: list the files.")
    previous = ledger.add("turn 1", gateway.exchanges(after=mark))[-1]
    assert "web_search" in previous.answer_headers.get("x-slotkeeper-omitted-tools", "")  # said so

    resumes = (("turn 2 (resume --last)", ["--last"]), ("turn 3 (resume ID)", [sid]))
    for scenario, args in resumes:
        mark = gateway.mark()
        assert codex_exec(codex, project, env, "resume", *args, f"{scenario}: run the tests.") == sid
        calls = ledger.add(scenario, gateway.exchanges(after=mark))
        ledger.check(calls, previous)
        previous = calls[-1]

    mark = gateway.mark()
    assert codex_exec(codex, project, env, "A new task: read the README.") != sid
    ledger.check(ledger.add("new session", gateway.exchanges(after=mark)), None)
    print(f"\nCodex {CODEX.version}, main calls:\n{ledger}")

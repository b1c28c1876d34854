"""llama-server's `return_progress` through `slotkeeper serve` (real engine processes): a tenant's
streamed chat gets the engine's prompt progress chunks, and a session restored from its slot file
reports what the restore served as the cache of its first report; a Responses stream reports it on
`response.in_progress` events."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

MODEL = "qwen35-seed0"
SYSTEM = "You are a coding agent. Read files, run tests, fix bugs, and report briefly. " * 4


def _stream(
    url: str, path: str, body: dict[str, Any], session: str
) -> tuple[list[dict[str, Any]], httpx.Headers]:
    with httpx.stream("POST", url + path, json=body, headers={"X-Session-Id": session}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        return chunks, r.headers


def _chat(
    url: str, messages: list[dict[str, Any]], session: str
) -> tuple[list[dict[str, Any]], httpx.Headers]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, "stream": True}
    return _stream(url, "/v1/chat/completions", {**body, "return_progress": True}, session)


def _reports(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c["prompt_progress"] for c in chunks if "prompt_progress" in c]


def test_progress_reaches_the_tenant_cold_and_restored(serve, tmp_path: Path) -> None:
    s = serve(tmp_path / "data", slots=1)
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Run the tests."}]
    chunks, headers = _chat(s.url, first, "agent-a")
    cold = _reports(chunks)
    assert headers["x-slotkeeper-cache"] == "cold"
    assert len(cold) >= 2 and cold[0]["cache"] == cold[0]["processed"] == 0
    assert cold[-1]["processed"] == cold[-1]["total"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))

    other = [{"role": "system", "content": "Another agent."}, {"role": "user", "content": "Hello."}]
    _chat(s.url, other, "agent-b")  # one slot: agent-a's state goes to its slot file

    again = [*first, {"role": "assistant", "content": text}, {"role": "user", "content": "And now?"}]
    chunks, headers = _chat(s.url, again, "agent-a")
    restored = _reports(chunks)
    assert headers["x-slotkeeper-cache"] == "restored"
    assert restored[0]["cache"] >= cold[-1]["total"] - 8  # what the restore served, before any batch
    assert restored[-1]["processed"] == restored[-1]["total"] > restored[0]["cache"]
    assert chunks[-1]["slotkeeper"]["restored"]


def test_progress_on_a_responses_stream(serve, tmp_path: Path) -> None:
    s = serve(tmp_path / "data", slots=1)
    body = {"model": MODEL, "input": SYSTEM, "max_output_tokens": 4, "stream": True, "return_progress": True}
    events, _ = _stream(s.url, "/v1/responses", body, "agent-r")
    progress = [e for e in events if "prompt_progress" in e]
    assert progress and all(e["type"] == "response.in_progress" for e in progress)
    assert progress[-1]["prompt_progress"]["processed"] == progress[-1]["prompt_progress"]["total"]

"""llama-server's `return_progress` through `slotkeeper serve` (real engine processes): a tenant's
streamed chat gets the engine's prompt progress chunks, and a session restored from its slot file
reports the restore's own progress first, then what the restore served as the cache of its first
prompt report; the official client reads them; a Responses stream reports the prompt's progress on
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

    # Before them, the restore's own progress (gateway.turn.restore_progress): the state fetched
    # from the store (this node keeps no copy), loaded, restored — then the engine's stream.
    fill = _restore_reports(chunks)
    stages = [p["stage"] for p in fill]
    assert stages[0] == "fetching" and stages[-2:] == ["restoring", "restored"], stages
    assert fill[-1]["bytes"] == fill[-1]["total"] > 0 and fill[-1]["tokens"] >= cold[-1]["total"] - 8
    first_prompt = next(i for i, c in enumerate(chunks) if "prompt_progress" in c)
    assert all("restore_progress" in c for c in chunks[: len(fill)]) and first_prompt == len(fill)
    assert not _restore_reports(_chat(s.url, [*again, {"role": "user", "content": "More."}], "agent-a")[0])


def _restore_reports(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c["restore_progress"] for c in chunks if "restore_progress" in c]


def test_the_openai_client_streams_a_restore_s_progress(serve, tmp_path: Path) -> None:
    """The official client reads the restore's chunks (no choices, a `restore_progress` field) as
    it reads usage chunks, and the answer after them is the answer."""
    from openai import OpenAI

    s = serve(tmp_path / "data", slots=1)
    client = OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Run the tests."}]
    chat: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    answer = client.chat.completions.create(messages=first, extra_headers={"X-Session-Id": "oa"}, **chat)
    text = answer.choices[0].message.content or ""
    client.chat.completions.create(messages=[{"role": "user", "content": "Hi."}], **chat)  # evicts it
    again = [*first, {"role": "assistant", "content": text}, {"role": "user", "content": "And now?"}]
    stream = client.chat.completions.create(
        messages=again,
        stream=True,
        extra_headers={"X-Session-Id": "oa"},
        extra_body={"return_progress": True},
        **chat,
    )
    progress, content = [], []
    for chunk in stream:
        extra = chunk.model_extra or {}
        if "restore_progress" in extra:
            assert chunk.choices == [] and not content
            progress.append(extra["restore_progress"])
        content += [c.delta.content or "" for c in chunk.choices]
    assert progress and progress[-1]["stage"] == "restored" and progress[-1]["tokens"] > 0
    assert "".join(content)  # the answer followed


def test_progress_on_a_responses_stream(serve, tmp_path: Path) -> None:
    s = serve(tmp_path / "data", slots=1)
    body = {"model": MODEL, "input": SYSTEM, "max_output_tokens": 4, "stream": True, "return_progress": True}
    events, _ = _stream(s.url, "/v1/responses", body, "agent-r")
    progress = [e for e in events if "prompt_progress" in e]
    assert progress and all(e["type"] == "response.in_progress" for e in progress)
    assert progress[-1]["prompt_progress"]["processed"] == progress[-1]["prompt_progress"]["total"]

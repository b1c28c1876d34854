"""The instance fence: a request that names an engine process (X-Slotkeeper-Instance) runs only on
that process. The gateway names it when it sends a turn before its opening read confirmed the
session's slot (gateway.turn.early); a restarted engine — whose slots may hold other sessions by then —
refuses it before anything reaches a slot."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ..conftest import EngineProcess, run_engine

KEY = "sk-fence-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _chat(text: str) -> dict[str, object]:
    return {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 2,
        "temperature": 0,
        "id_slot": 0,
        "cache_prompt": True,
    }


@pytest.fixture(scope="module")
def fenced(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    args = ("-np", "2", "--api-key", KEY, "--instance-id", "run-7f3a")
    yield from run_engine(tmp_path_factory, models["qwen35"], *args)


def _slot0(c: httpx.Client) -> dict[str, object]:
    return next(s for s in c.get("/slots", headers=AUTH).json() if s["id"] == 0)


def test_a_request_naming_this_process_runs(fenced: EngineProcess) -> None:
    with httpx.Client(base_url=fenced.url, timeout=60) as c:
        r = c.post(
            "/v1/chat/completions",
            json=_chat("Hello there."),
            headers={**AUTH, "X-Slotkeeper-Instance": "run-7f3a"},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_a_request_naming_another_process_is_refused_before_it_reaches_a_slot(fenced: EngineProcess) -> None:
    with httpx.Client(base_url=fenced.url, timeout=60) as c:
        assert (
            c.post(
                "/v1/chat/completions", json=_chat("The slot's own conversation."), headers=AUTH
            ).status_code
            == 200
        )
        before = _slot0(c)
        for named in ("run-0000", "", "RUN-7F3A", "run-7f3a0"):
            r = c.post(
                "/v1/chat/completions",
                json=_chat("Someone else's prompt, much longer than that."),
                headers={**AUTH, "X-Slotkeeper-Instance": named},
            )
            assert r.status_code == 409, (named, r.text)
            assert r.json()["error"]["code"] == "engine_instance_changed"
        for path in ("/completion", "/v1/completions", "/v1/messages", "/v1/responses"):
            r = c.post(
                path,
                json={"prompt": "x", "max_tokens": 1, "id_slot": 0},
                headers={**AUTH, "X-Slotkeeper-Instance": "run-0000"},
            )
            assert r.status_code == 409, (path, r.text)
        assert _slot0(c)["n_tokens"] == before["n_tokens"]  # the slot was never touched


def test_the_key_is_checked_before_the_fence(fenced: EngineProcess) -> None:
    with httpx.Client(base_url=fenced.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json=_chat("hi"), headers={"X-Slotkeeper-Instance": "run-0000"})
        assert r.status_code == 401  # a caller without the credential learns nothing about instances


def test_an_engine_without_an_instance_id_refuses_every_named_request(
    llama_engine: EngineProcess,
) -> None:
    with httpx.Client(base_url=llama_engine.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json=_chat("hi"), headers={"X-Slotkeeper-Instance": "anything"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "engine_instance_changed"
        assert c.post("/v1/chat/completions", json=_chat("hi")).status_code == 200  # unnamed: as ever

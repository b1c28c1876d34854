"""The prefill/decode split through `slotkeeper serve` (gateway.turn.handoff): one node running a
prefill and a decode engine of the tiny qwen35, tenants with thresholds of 0 (always), off (never)
and the default (2048 uncached tokens).

A split turn's decode side evaluates 0 prompt tokens and answers exactly as an unsplit turn; its
session then lives on the decode engine; a prefill engine that is gone costs one unsplit turn,
never an error. Roles show in the node's engine listing, the engines' /v1/models and the metrics.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.bench.harness.servers import INTERNAL_AUTH

from .conftest import Serve, eventually, start_serve

MODEL = "qwen35-seed0"
TENANTS = """
[tenants.split]
keys = ["key-split"]
handoff_threshold = 0
[tenants.whole]
keys = ["key-whole"]
handoff_threshold = "off"
[tenants.usual]
keys = ["key-usual"]
"""
SYSTEM = "You are a careful assistant. Answer briefly and exactly. " * 6


@pytest.fixture
def split_serve(tiny_model: Callable[..., str], tmp_path: Path) -> Iterator[Serve]:
    model = tiny_model("qwen35")
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    args = ("--model", model, "--role", "prefill", "--role", "decode")
    s = start_serve(model, tmp_path / "data", tmp_path / "serve.log", slots=2, tenants=tenants, args=args)
    # Ready once one engine is registered: wait for the other too.
    eventually("both engines ready", lambda: [e["state"] for e in s.engines()] == ["ready", "ready"], 60)
    probe = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    eventually(
        "the decode engine registered",
        lambda: (
            httpx.post(
                s.url + "/v1/chat/completions",
                json=probe,
                headers={"Authorization": "Bearer key-whole"},
                timeout=60,
            ).status_code
            == 200
        ),
        30,
    )
    yield s
    s.stop(signal.SIGKILL, timeout=30)


def _chat(s: Serve, key: str, session: str, messages: list[dict[str, Any]]) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0}
    headers = {"Authorization": f"Bearer {key}", "X-Session-Id": session}
    r = httpx.post(s.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r


def _conversation(user: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def _text(r: httpx.Response) -> str:
    return str(r.json()["choices"][0]["message"]["content"])


def _metric(url: str, line: str, headers: dict[str, str] | None = None) -> float:
    text = httpx.get(url + "/metrics", timeout=10, headers=headers or {}).text
    found = [ln for ln in text.splitlines() if ln.startswith(line + " ")]
    return float(found[0].split()[-1]) if found else 0.0


def test_a_split_turn_evaluates_nothing_on_the_decode_side_and_answers_as_unsplit(split_serve: Serve) -> None:
    s = split_serve
    engines = s.engines()
    assert [e["role"] for e in engines] == ["prefill", "decode"]
    prefill, decode = engines
    models = httpx.get(decode["url"] + "/v1/models", headers=INTERNAL_AUTH, timeout=5).json()
    assert models["data"][0]["role"] == "decode"
    assert _metric(s.node_url, 'slotkeeper_node_engine_roles{role="prefill"}', INTERNAL_AUTH) == 1

    messages = _conversation("Tell me about the weather, the time and the place of the meeting.")
    whole = _chat(s, "key-whole", "w1", messages)  # never split: the decode engine prefills
    split = _chat(s, "key-split", "s1", messages)
    n_prompt = whole.json()["timings"]["prompt_n"]
    assert n_prompt == whole.json()["usage"]["prompt_tokens"] > 100
    assert whole.headers["X-Slotkeeper-Cache"] == "cold"
    assert split.headers["X-Slotkeeper-Cache"] == "handoff"
    assert split.json()["slotkeeper"]["served"] == "handoff"
    assert split.json()["timings"]["prompt_n"] == 0  # sampled from the handed logits
    assert split.json()["usage"]["prompt_tokens"] == n_prompt
    assert _text(split) == _text(whole) and _text(split)
    assert _metric(s.url, 'slotkeeper_gateway_handoffs_total{result="done"}') == 1
    assert _metric(s.url, "slotkeeper_gateway_handoff_bytes_total") > 0
    assert _metric(s.node_url, 'slotkeeper_node_handoffs_total{result="done"}', INTERNAL_AUTH) == 1

    # The session lives on the decode engine: its next turn runs live there, on the new tokens only.
    messages += [
        {"role": "assistant", "content": _text(split)},
        {"role": "user", "content": "And the day after?"},
    ]
    follow = _chat(s, "key-split", "s1", messages)
    assert follow.headers["X-Slotkeeper-Cache"] == "live"
    assert 0 < follow.json()["timings"]["prompt_n"] < 40
    assert _metric(s.url, 'slotkeeper_gateway_handoffs_total{result="done"}') == 1

    # The default threshold (2048 uncached tokens) leaves a short prompt where it is.
    usual = _chat(s, "key-usual", "u1", _conversation("Tell me about the weather, the time and the place."))
    assert usual.headers["X-Slotkeeper-Cache"] == "cold"


def test_a_prefill_engine_gone_costs_one_unsplit_turn(split_serve: Serve) -> None:
    s = split_serve
    prefill = s.engines()[0]
    os.kill(prefill["pid"], signal.SIGKILL)
    messages = _conversation("What is on the agenda of the meeting tomorrow morning?")
    r = _chat(s, "key-split", "s2", messages)
    assert r.headers["X-Slotkeeper-Cache"] == "cold"
    assert r.json()["timings"]["prompt_n"] == r.json()["usage"]["prompt_tokens"]
    assert _metric(s.url, 'slotkeeper_gateway_handoffs_total{result="done"}') == 0
    # (Its node may have unregistered it before the turn came — no handoff tried — or not: then the
    # handoff failed, counted by the reason.)
    failed = [
        _metric(s.url, f'slotkeeper_gateway_handoffs_total{{result="{x}"}}')
        for x in ("failed", "unavailable")
    ]
    assert sum(failed) <= 1
    # Restarted by its supervisor, it takes a later split turn again.
    eventually(
        "the prefill engine restarted",
        lambda: s.engines()[0]["state"] == "ready" and s.engines()[0]["pid"] != prefill["pid"],
        60,
    )
    n = iter(range(1000))

    def split_again() -> bool:
        body = {"model": MODEL, "messages": _conversation("Who comes?"), "max_tokens": 4, "temperature": 0}
        headers = {"Authorization": "Bearer key-split", "X-Session-Id": f"s-again-{next(n)}"}
        r = httpx.post(s.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
        # (503: both decode slots held by the last turns' saves a moment longer)
        assert r.status_code in (200, 503), r.text
        return r.status_code == 200 and r.headers["X-Slotkeeper-Cache"] == "handoff"

    eventually("a split turn after the restart", split_again, 30)

"""End to end through `slotkeeper serve` on a real quantized model: Gemma 3 270M (Q4_K_M).

Its GGUF has no chat template, so the engine chats with the ChatML fallback. A conversation whose
serve process is SIGKILLed after turn 3 was saved, then restarted on the same data directory,
answers turn 3 again and turn 4 with the same text as an uninterrupted run of the same conversation
— the same slot state either way, so greedy decoding must agree token for token — and
`usage.prompt_tokens_details.cached_tokens` shows that the restored state was reused, not
re-prefilled.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any, cast

import httpx
import openai
import pytest

from .conftest import Serve, start_serve

pytestmark = pytest.mark.slow

MODEL = "gemma-3-270m-q4_k_m"  # the file name without .gguf
SESSION = "gemma-chat"
SYSTEM = {"role": "system", "content": "You are a helpful geography tutor. Answer briefly."}
# Gemma 3 270M here is the base model, and ChatML's markers are plain text to it: it mostly echoes
# the conversation, but what it echoes depends on the whole state (the story's animal changes).
QUESTIONS = [
    "Tell me a short story about a cat.",
    "Now continue the story with a dog.",
    "Count from one to five.",
    "What is two plus two?",
]


def _serve(gemma_model: Path, data: Path, log: Path) -> Serve:
    return start_serve(str(gemma_model), data, log, slots=1)


def _turn(s: Serve, messages: list[dict[str, Any]]) -> tuple[str, int, int, str]:
    """(text, prompt tokens, cached tokens, x-slotkeeper-cache) of one greedy turn."""
    with openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=cast(Any, messages),
            max_tokens=16,
            temperature=0,
            extra_headers={"X-Session-Id": SESSION},
        )
        done = raw.parse()
    assert done.usage is not None and done.usage.prompt_tokens_details is not None
    cached = done.usage.prompt_tokens_details.cached_tokens or 0
    text = done.choices[0].message.content or ""
    return text, done.usage.prompt_tokens, cached, raw.headers["x-slotkeeper-cache"]


def _wait_durable(s: Serve, generation: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if httpx.get(f"{s.url}/v1/sessions/{SESSION}", timeout=5).json().get("generation", 0) >= generation:
            return
        time.sleep(0.05)
    raise AssertionError(f"turn {generation} of {SESSION} did not become durable within {timeout_s} s")


def _messages(answers: list[str], n: int) -> list[dict[str, Any]]:
    """The conversation up to question n (1-based), with the answers given so far."""
    out: list[dict[str, Any]] = [SYSTEM]
    for i in range(n):
        out.append({"role": "user", "content": QUESTIONS[i]})
        if i < n - 1:
            out.append({"role": "assistant", "content": answers[i]})
    return out


def test_a_sigkilled_serve_answers_as_an_uninterrupted_one(gemma_model: Path, tmp_path: Path) -> None:
    steady = _serve(gemma_model, tmp_path / "steady", tmp_path / "steady.log")
    try:
        reference: list[tuple[str, int, int, str]] = []
        for n in range(1, 5):
            reference.append(_turn(steady, _messages([r[0] for r in reference], n)))
    finally:
        assert steady.stop() == 0
    assert [r[3] for r in reference] == ["cold", "live", "live", "live"]
    answers = [r[0] for r in reference]
    for n in range(1, 4):
        assert reference[n][2] >= reference[n - 1][1]  # each turn reuses at least the previous prompt

    data = tmp_path / "crash"
    first = _serve(gemma_model, data, tmp_path / "first.log")
    try:
        crashed = [_turn(first, _messages(answers, n)) for n in range(1, 4)]
        _wait_durable(first, 3)  # turn 3's after-turn save is in the blob store
    finally:
        assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    assert crashed == reference[:3]

    second = _serve(gemma_model, data, tmp_path / "second.log")
    try:
        again = _turn(second, _messages(answers, 3))
        fourth = _turn(second, _messages(answers, 4))
    finally:
        assert second.stop() == 0
    # The engines chatted with the ChatML fallback (the GGUF has no template).
    engine_log = (data / "engines" / "local-e0" / "engine.log").read_text()
    chosen = [json.loads(line) for line in engine_log.splitlines() if '"engine.chat_template"' in line]
    assert [e["origin"] for e in chosen] == ["chatml-fallback", "chatml-fallback"]
    # Turn 3 again: the restored state already holds its whole prompt (nothing re-evaluated).
    text, prompt, cached, cache = again
    assert (text, prompt, cache) == (reference[2][0], reference[2][1], "restored")
    assert cached == prompt
    # Turn 4 on the restored slot: the same answer as the uninterrupted run, as much reused.
    assert fourth[0] == reference[3][0]
    assert fourth[1:3] == reference[3][1:3] and fourth[2] >= reference[2][1]

"""A real quantized model: Gemma 3 270M (Q4_K_M, sliding-window attention, 262k vocabulary).

Its GGUF has no chat template, so the engine chats with the ChatML fallback (as llama-server
does) unless `--chat-template gemma` asks for Gemma's own turns. Slot state survives a save → SIGKILL
→ restart → restore: `timings.prompt_n` shows that the next turn evaluates only its new tokens, a
prompt that diverges inside the saved one reuses up to the divergence and the identical prompt
evaluates nothing — with the same greedy text as the same slot that never left memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_pool.server.builtin_templates import CHATML
from engine_pool.server.chat_template import ChatTemplate
from engine_pool.server.slot_leases import common_prefix

from ..conftest import EngineProcess, run_engine

pytestmark = pytest.mark.slow

BOS = 2  # <bos>
START_OF_TURN = 105  # <start_of_turn>, one special token in Gemma's vocabulary
TURN1 = [
    {"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
]


def post(c: httpx.Client, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def render(c: httpx.Client, messages: list[dict[str, Any]]) -> str:
    return str(post(c, "/apply-template", {"messages": messages})["prompt"])


def tokenize(c: httpx.Client, text: str, add_special: bool = True) -> list[int]:
    return list(post(c, "/tokenize", {"content": text, "add_special": add_special})["tokens"])


def complete(c: httpx.Client, prompt: list[int], n: int = 8) -> dict[str, Any]:
    body = {"prompt": prompt, "id_slot": 0, "n_predict": n, "temperature": 0, "ignore_eos": True}
    out = post(c, "/completion", body)
    assert out["id_slot"] == 0
    return out


def logged(eng: EngineProcess, event: str) -> list[dict[str, Any]]:
    lines = (json.loads(line) for line in eng.log().splitlines() if line.startswith("{"))
    return [e for e in lines if e["event"] == event]


@pytest.fixture(scope="module")
def gemma(gemma_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    yield from run_engine(tmp_path_factory, gemma_model, "-np", "1", "-c", "2048")


def test_no_template_in_the_gguf_falls_back_to_chatml(gemma: EngineProcess) -> None:
    with httpx.Client(base_url=gemma.url, timeout=120) as c:
        text = render(c, TURN1)
        assert text == ChatTemplate(CHATML).render(TURN1)
        r = post(c, "/v1/chat/completions", {"messages": TURN1, "max_tokens": 8, "temperature": 0})
        assert r["usage"]["prompt_tokens"] == len(tokenize(c, text))
        props = c.get("/props").json()
        assert props["chat_template"] == CHATML
        assert props["slotkeeper"]["chat_template_origin"] == "chatml-fallback"
    assert r["usage"]["completion_tokens"] >= 1 and r["choices"][0]["message"]["content"]
    [fallback] = logged(gemma, "engine.chat_template_fallback")
    assert fallback["reason"] == "the model has no chat template"
    assert [e["origin"] for e in logged(gemma, "engine.chat_template")] == ["chatml-fallback"]


def test_the_chatml_fallback_stops_on_its_end_marker_written_as_text(gemma: EngineProcess) -> None:
    # Gemma's vocabulary has no <|im_end|> token: the model writes the marker as text (forced here).
    body = {
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 32,
        "grammar": 'root ::= "Red." "<|im_end|>" [a-z ]*',
    }
    with httpx.Client(base_url=gemma.url, timeout=120) as c:
        for stream in (False, True):
            if stream:
                with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                    events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
                text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
                finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]
            else:
                choice = post(c, "/v1/chat/completions", body)["choices"][0]
                text, finish = choice["message"]["content"], choice["finish_reason"]
            assert (text, finish) == ("Red.", "stop"), stream


def test_chat_template_gemma(gemma_model: Path, tmp_path: Path) -> None:
    args = ("--chat-template", "gemma")
    eng = EngineProcess(gemma_model, *args, log_path=tmp_path / "engine.log").start()
    try:
        with httpx.Client(base_url=eng.url, timeout=120) as c:
            text = render(c, TURN1)
            assert text == (
                "<bos><start_of_turn>user\nYou are a helpful assistant. Answer in one short sentence.\n\n"
                "What is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
            )
            # The template writes the BOS text, so the engine adds none (one BOS in the prompt), and
            # Gemma's turn markers are single tokens.
            tokens = tokenize(c, text, add_special=False)
            assert tokens.count(BOS) == 1 and tokens[:2] == [BOS, START_OF_TURN]
            assert tokens.count(START_OF_TURN) == 2
            r = post(c, "/v1/chat/completions", {"messages": TURN1, "max_tokens": 8, "temperature": 0})
            assert r["usage"]["prompt_tokens"] == len(tokens)
            assert r["usage"]["completion_tokens"] >= 1
    finally:
        assert eng.stop() == 0
    assert [e["origin"] for e in logged(eng, "engine.chat_template")] == ["builtin:gemma"]
    assert not logged(eng, "engine.chat_template_fallback")


def test_save_kill_restart_restore(gemma_model: Path, tmp_path: Path) -> None:
    """Prompts are the engine's ChatML renderings of a conversation, sent as token ids to
    /completion so that the slot's exact tokens are known."""
    args = ("-np", "1", "-c", "2048", "--slot-save-path", str(tmp_path / "slots"))
    first = EngineProcess(gemma_model, *args, log_path=tmp_path / "first.log").start()
    try:
        with httpx.Client(base_url=first.url, timeout=120) as c:
            p1 = tokenize(c, render(c, TURN1))
            r1 = complete(c, p1)
            saved = post(c, "/slots/0?action=save", {"filename": "turn1.slot"})
            slot = (p1 + r1["tokens"])[: saved["n_saved"]]  # what the slot holds
            reply = {"role": "assistant", "content": r1["content"]}
            p2 = tokenize(c, render(c, [*TURN1, reply, {"role": "user", "content": "And of Italy?"}]))
            other = tokenize(c, " Tell me about the weather instead.", add_special=False)
            live = complete(c, p2)  # the next turn on the slot that never left memory
            # References for the same slot state after a restore in this process.
            post(c, "/slots/0?action=restore", {"filename": "turn1.slot"})
            cut = len(p1) - 6
            divergent = p1[:cut] + other
            assert other[0] != p1[cut]
            live_div = complete(c, divergent)
    finally:
        first.kill()  # a crash: only what was saved survives

    assert r1["timings"]["prompt_n"] == len(p1)
    assert saved["n_saved"] > len(p1) and saved["n_checkpoints"] >= 1
    keep = common_prefix(p2, slot)
    assert keep >= len(p1)  # the next turn repeats the whole first prompt
    assert live["timings"]["prompt_n"] == len(p2) - keep

    second = EngineProcess(gemma_model, *args, log_path=tmp_path / "second.log").start()
    try:
        with httpx.Client(base_url=second.url, timeout=120) as c:
            restored = post(c, "/slots/0?action=restore", {"filename": "turn1.slot"})
            assert (restored["n_restored"], restored["n_read"]) == (saved["n_saved"], saved["n_written"])
            nxt = complete(c, p2)
            post(c, "/slots/0?action=restore", {"filename": "turn1.slot"})
            div = complete(c, divergent)
            post(c, "/slots/0?action=restore", {"filename": "turn1.slot"})
            same = complete(c, p1)
    finally:
        assert second.stop() == 0

    # Next turn: only the tokens after the common prefix, and the live slot's text.
    assert nxt["slotkeeper"]["restored"] is True
    assert nxt["timings"]["prompt_n"] == len(p2) - keep == live["timings"]["prompt_n"]
    assert nxt["timings"]["cache_n"] == keep
    assert nxt["content"] == live["content"] and nxt["tokens"] == live["tokens"]
    # Divergent: reused up to the divergence.
    assert div["timings"]["cache_n"] == cut and div["timings"]["prompt_n"] == len(other)
    assert div["tokens"] == live_div["tokens"]
    # Identical: nothing evaluated (the stored logits of the prompt's end), the first answer again.
    assert same["timings"]["prompt_n"] == 0 and same["timings"]["cache_n"] == len(p1)
    assert same["tokens"] == r1["tokens"]

"""llama-server's endpoints on a real engine: props, slots, tokens, templates, metrics, stops, slot choice."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ..conftest import CHECKPOINT_ARGS, EngineProcess, run_engine
from .test_slot_scenario import complete, slot_action, tokenize

PROMPT = "The model state is saved in a slot cache, then restored for the user."


@pytest.fixture(scope="module")
def qwen_engine(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """The shared qwen engine's flags plus `--metrics`: an engine serves /metrics only when asked."""
    slots = str(tmp_path_factory.mktemp("qwen-metrics-slots"))
    args = ("-np", "2", "-c", "2048", "--slot-save-path", slots, "-a", "tiny-qwen")
    yield from run_engine(tmp_path_factory, models["qwen35"], *args, "--metrics", *CHECKPOINT_ARGS)


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in metrics"
    return float(m.group(1))


def test_props_and_models(qwen: httpx.Client) -> None:
    p = qwen.get("/props").json()
    assert p["total_slots"] == 2 and p["model_alias"] == "tiny-qwen"
    assert p["default_generation_settings"]["n_ctx"] == 1024
    assert "<|im_start|>" in p["chat_template"]
    assert p["slotkeeper"]["hybrid"] is True and len(p["slotkeeper"]["fingerprint"]) == 64
    m = qwen.get("/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == "tiny-qwen" and m["data"][0]["meta"]["hybrid"]


def test_slots_view(qwen: httpx.Client) -> None:
    slots = qwen.get("/slots").json()
    assert [s["id"] for s in slots] == [0, 1]
    assert set(slots[0]) >= {"id", "id_task", "n_ctx", "is_processing", "n_tokens", "n_checkpoints", "queued"}
    assert qwen.get("/slots?fail_on_no_slot=1").status_code == 200


def test_tokenize_detokenize_round_trip(llama: httpx.Client) -> None:
    tokens = tokenize(llama, "héllo <tool_call> world", add_special=False)
    assert llama.post("/detokenize", json={"tokens": tokens}).json()["content"] == "héllo <tool_call> world"
    pieces = llama.post("/tokenize", json={"content": "é<tool_call>", "with_pieces": True}).json()["tokens"]
    assert all(set(p) == {"id", "piece"} for p in pieces)
    assert pieces[-1]["piece"] == "<tool_call>"
    with_bos = llama.post("/tokenize", json={"content": "hi", "add_special": True}).json()["tokens"]
    assert with_bos[0] == 1 and with_bos[1:] == tokenize(llama, "hi", add_special=False)


def test_apply_template(llama: httpx.Client) -> None:
    r = llama.post("/apply-template", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert r["prompt"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_stop_strings_cut_the_text_streamed_or_not(llama: httpx.Client) -> None:
    full = complete(llama, PROMPT, 0, n=24)
    text = full["content"]
    stop = text[8:11] if text[8:11].strip() else text[10:13]
    idx = text.find(stop)
    r = complete(llama, PROMPT, 0, n=24, stop=[stop, "never-seen"])
    assert r["content"] == text[:idx]
    assert (r["stop_type"], r["stopping_word"]) == ("word", stop)
    assert r["timings"]["predicted_n"] <= 24
    with llama.stream(
        "POST",
        "/completion",
        json={
            "prompt": PROMPT,
            "id_slot": 0,
            "n_predict": 24,
            "temperature": 0,
            "ignore_eos": True,
            "stop": [stop],
            "stream": True,
        },
    ) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == text[:idx]
    assert events[-1]["stop"] is True and events[-1]["stop_type"] == "word" and "timings" in events[-1]


def test_chat_stop_string(llama: httpx.Client) -> None:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 16,
        "temperature": 0,
    }
    text = llama.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    stop = text[5:8]
    r = llama.post("/v1/chat/completions", json={**body, "stop": stop}).json()
    assert r["choices"][0]["message"]["content"] == text[: text.find(stop)]
    assert r["choices"][0]["finish_reason"] == "stop"


def test_request_without_id_slot_goes_to_the_slot_holding_its_prefix(llama: httpx.Client) -> None:
    for slot in (0, 1):
        slot_action(llama, slot, "erase")
    a = tokenize(llama, PROMPT * 2)
    first = complete(llama, a, 1)
    extra = tokenize(llama, " and then some more words", add_special=False)
    r = llama.post("/completion", json={"prompt": a + extra, "n_predict": 2, "temperature": 0}).json()
    assert r["id_slot"] == 1
    assert r["timings"]["prompt_n"] <= len(extra) + 1 and r["timings"]["cache_n"] >= len(a) - 1
    other = llama.post("/completion", json={"prompt": "Completely different words", "n_predict": 2}).json()
    assert other["id_slot"] == 0  # no useful prefix anywhere: the least recently used slot
    assert first["id_slot"] == 1


def test_cache_prompt_false_evaluates_everything(llama: httpx.Client) -> None:
    a = tokenize(llama, PROMPT)
    complete(llama, a, 0)
    r = complete(llama, a, 0, cache_prompt=False)
    assert r["timings"]["prompt_n"] == len(a) and r["timings"]["cache_n"] == 0


def test_tool_choice_none_bans_the_tool_call_token(qwen: httpx.Client) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    grammar = 'root ::= "<tool_call>" [a-z]{1,3} | "plain"'
    r = qwen.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "tools": tools,
            "tool_choice": "none",
            "grammar": grammar,
            "max_tokens": 20,
            "temperature": 0,
        },
    ).json()
    message = r["choices"][0]["message"]
    assert "tool_calls" not in message
    assert message["content"] == "plain"  # the <tool_call> token was not available


def test_metrics_count_reuse_by_source(qwen: httpx.Client) -> None:
    before = qwen.get("/metrics").text
    a = tokenize(qwen, PROMPT)
    complete(qwen, a, 0)
    r = complete(qwen, a, 0)  # identical prompt: served from the stored logits
    assert r["slotkeeper"]["reuse"] == "logits" and r["timings"]["prompt_n"] == 0
    after = qwen.get("/metrics").text
    name = 'slotkeeper_prompt_tokens_reused_total{source="logits"}'
    assert _metric(after, name) - _metric(before, name) == len(a)
    assert _metric(after, "slotkeeper_prompt_tokens_evaluated_total") >= len(a)
    for family in (
        "slotkeeper_restores_reprefilled_total",
        "slotkeeper_checkpoints_created_total",
        "slotkeeper_slots_busy",
        "slotkeeper_slots_total",
        "slotkeeper_queue_waiting",
        "slotkeeper_prompt_tokens_reused_after_restore_total",
    ):
        assert re.search(rf"^{family}", after, re.M), family
    assert 'slotkeeper_http_requests_total{route="/completion",status="200"}' in after

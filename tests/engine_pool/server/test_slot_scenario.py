"""llama-server's slot save/restore scenario, for an attention model (llama) and a hybrid one (qwen35).

`timings.prompt_n` proves what was reused: after a save, another prompt in the same slot, and a
restore into another slot — and after the process was killed and a new one started on the same
--slot-save-path — a prompt that extends the saved one evaluates only its new tokens, the identical
prompt evaluates nothing, and a prompt that diverges inside the saved one evaluates exactly as much
as it would have in a slot that never left memory. Greedy outputs match the live slot's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from ..conftest import CHECKPOINT_ARGS, EngineProcess

TEXT_A = (
    "The model state is saved in a slot cache, then restored for the user. Every session keeps its "
    "state so that the next turn only has to process what is new. "
) * 2
TEXT_B = "Hello world! A different prompt about the weather, the time and the place of the meeting."
OTHER = " return class import self print study still learn should world"
ENGINES = {"llama": "llama_engine", "qwen35": "qwen_engine"}


def tokenize(c: httpx.Client, text: str, add_special: bool = True) -> list[int]:
    r = c.post("/tokenize", json={"content": text, "add_special": add_special})
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def complete(c: httpx.Client, prompt: Any, slot: int, n: int = 4, **kw: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "id_slot": slot, "n_predict": n, "temperature": 0, "ignore_eos": True, **kw}
    r = c.post("/completion", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    assert out["id_slot"] == slot
    return out


def slot_action(c: httpx.Client, slot: int, action: str, filename: str | None = None) -> dict[str, Any]:
    r = c.post(f"/slots/{slot}", params={"action": action}, json={"filename": filename} if filename else None)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def slot_tokens(c: httpx.Client, slot: int) -> int:
    return int(c.get("/slots").json()[slot]["n_tokens"])


def extension(c: httpx.Client, generated: list[int]) -> list[int]:
    """Tokens to append to the prompt that do not continue it the way the model did."""
    extra = tokenize(c, OTHER, add_special=False)
    while extra[0] == generated[0]:
        extra = extra[1:] + extra[:1]
    return extra


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_save_other_prompt_restore_into_other_slot(
    arch: str, request: pytest.FixtureRequest, slot_dir: Path
) -> None:
    eng: EngineProcess = request.getfixturevalue(ENGINES[arch])
    c = httpx.Client(base_url=eng.url, timeout=60)
    for slot in (0, 1):
        slot_action(c, slot, "erase")
    a, b = tokenize(c, TEXT_A), tokenize(c, TEXT_B)

    r1 = complete(c, a, 1)
    assert r1["timings"]["prompt_n"] == len(a)
    saved = slot_action(c, 1, "save", "scenario.slot")
    assert saved["n_saved"] == slot_tokens(c, 1) > len(a)
    assert saved["n_written"] == (slot_dir / arch / "scenario.slot").stat().st_size
    assert saved["n_checkpoints"] >= 1

    r2 = complete(c, b, 1)
    assert r2["timings"]["prompt_n"] >= len(b) - 1  # at most a shared BOS reused

    restored = slot_action(c, 0, "restore", "scenario.slot")
    assert (restored["n_restored"], restored["n_read"]) == (saved["n_saved"], saved["n_written"])
    extra = extension(c, r1["tokens"])
    r3 = complete(c, a + extra, 0)
    assert r3["timings"]["prompt_n"] == len(extra), r3["timings"]
    assert r3["timings"]["cache_n"] == len(a)
    assert r3["slotkeeper"]["restored"] is True

    # The same request on a slot whose state never left memory: same work, same tokens (on its
    # own: from slot 0's state it would evaluate nothing).
    complete(c, a, 1, prefix_slots=[])
    live = complete(c, a + extra, 1, prefix_slots=[])
    assert live["timings"]["prompt_n"] == len(extra)
    assert live["tokens"] == r3["tokens"]

    # Identical prompt on a restored slot: nothing evaluated, same greedy output as the first run.
    slot_action(c, 0, "restore", "scenario.slot")
    r4 = complete(c, a, 0)
    assert r4["timings"]["prompt_n"] == 0
    assert r4["timings"]["cache_n"] == len(a)
    assert r4["tokens"] == r1["tokens"]
    c.close()


def _divergent(a: list[int], other: list[int]) -> list[int]:
    return a[: len(a) - 12] + other


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_restart_restore_extend_identical_divergent(
    arch: str, models: dict[str, Path], tmp_path: Path
) -> None:
    slots = str(tmp_path / "slots")
    args = ("-np", "2", "-c", "2048", "--slot-save-path", slots, "--metrics", *CHECKPOINT_ARGS)
    first = EngineProcess(models[arch], *args, log_path=tmp_path / "first.log").start()
    try:
        c = httpx.Client(base_url=first.url, timeout=60)
        a = tokenize(c, TEXT_A)
        other = tokenize(c, OTHER, add_special=False)
        r1 = complete(c, a, 0)
        assert complete(c, a, 1)["tokens"] == r1["tokens"]
        saved = slot_action(c, 1, "save", "a.slot")
        extra = extension(c, r1["tokens"])
        live_ext = complete(c, a + extra, 0)  # live references, in slots that never left memory
        live_div = complete(c, _divergent(a, other), 1)
        assert live_ext["timings"]["prompt_n"] == len(extra)
        assert live_div["timings"]["prompt_n"] < len(_divergent(a, other))
        c.close()
    finally:
        first.kill()  # a crash: only what was saved survives

    second = EngineProcess(models[arch], *args, log_path=tmp_path / "second.log").start()
    try:
        c = httpx.Client(base_url=second.url, timeout=60)
        assert slot_action(c, 0, "restore", "a.slot")["n_restored"] == saved["n_saved"]
        ext = complete(c, a + extra, 0)
        assert ext["timings"]["prompt_n"] == len(extra)
        assert ext["tokens"] == live_ext["tokens"]

        slot_action(c, 1, "restore", "a.slot")
        div = complete(c, _divergent(a, other), 1)
        assert div["timings"]["prompt_n"] == live_div["timings"]["prompt_n"]
        assert div["tokens"] == live_div["tokens"]

        slot_action(c, 0, "restore", "a.slot")
        same = complete(c, a, 0)
        assert same["timings"]["prompt_n"] == 0
        assert same["tokens"] == r1["tokens"]

        metrics = c.get("/metrics").text
        assert "slotkeeper_restores_reprefilled_total 0.0" in metrics
        c.close()
    finally:
        assert second.stop() == 0
    assert "restore.reprefilled" not in second.log()


def _chat_prompt(
    c: httpx.Client, messages: list[dict[str, Any]], generation_prompt: bool = True
) -> list[int]:
    body = {"messages": messages, "add_generation_prompt": generation_prompt}
    text = c.post("/apply-template", json=body).json()["prompt"]
    return tokenize(c, text)


def _chat(c: httpx.Client, messages: list[dict[str, Any]], slot: int) -> dict[str, Any]:
    r = c.post(
        "/v1/chat/completions",
        json={"messages": messages, "id_slot": slot, "max_tokens": 6, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_hybrid_chat_turns_reuse_checkpoints_after_restore(qwen: httpx.Client) -> None:
    """Agent turns on a restored hybrid slot reuse the saved checkpoints as much as a live slot does."""
    system = {"role": "system", "content": "You are a helpful model. " * 6}
    turn1 = [system, {"role": "user", "content": "hello world, what is the state of the slot cache?"}]
    for slot in (0, 1):
        slot_action(qwen, slot, "erase")
    first = _chat(qwen, turn1, 1)
    slot_action(qwen, 1, "save", "chat.slot")
    prompt1 = _chat_prompt(qwen, turn1)
    assert first["usage"]["prompt_tokens"] == len(prompt1)

    # Next turn: the template re-renders the assistant reply, which diverges from the generated tokens.
    reply = {"role": "assistant", "content": "It is saved."}
    turn2 = [*turn1, reply, {"role": "user", "content": "and now?"}]
    live = _chat(qwen, turn2, 1)
    slot_action(qwen, 0, "restore", "chat.slot")
    restored = _chat(qwen, turn2, 0)
    assert restored["timings"]["prompt_n"] == live["timings"]["prompt_n"]
    assert restored["usage"]["prompt_tokens_details"]["cached_tokens"] == live["timings"]["cache_n"]
    assert restored["timings"]["cache_n"] >= len(prompt1) - 3  # up to the end of the previous prompt
    assert restored["choices"][0]["message"]["content"] == live["choices"][0]["message"]["content"]

    # Another session of the same agent: only the system prefix is shared (its hint checkpoint).
    slot_action(qwen, 0, "restore", "chat.slot")
    fresh = [system, {"role": "user", "content": "a different question entirely"}]
    other = _chat(qwen, fresh, 0)
    prefix = _chat_prompt(qwen, [system], generation_prompt=False)
    assert other["timings"]["cache_n"] >= len(prefix) - 3
    assert other["slotkeeper"]["reuse"] == "checkpoint"

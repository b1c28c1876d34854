"""The stored checkpoint ladder on real engine processes: a long session's slot file stays within
`--stored-checkpoints` turn after turn while the live slot keeps its own ladder, and a restore from
that bounded ladder answers what the live slot answers — the next turn, and a branch that leaves the
conversation early (a rollback to a stored checkpoint, never a whole re-prefill).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from storage.slotfile.reader import read_slot_file

from ..conftest import EngineProcess, run_engine

STORED = 4
SYSTEM = "You are a build agent. Run the tools, read their output, and report what changed. " * 5
ARGS = ("-np", "2", "-c", "8192", "--checkpoint-interval", "32", "--checkpoint-min-step", "8")
ARGS += ("--stored-checkpoints", str(STORED))


@pytest.fixture(scope="module")
def slot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ladder")


def _engine(
    tmp_path_factory: pytest.TempPathFactory, models: dict[str, Path], slot_dir: Path
) -> Iterator[EngineProcess]:
    yield from run_engine(tmp_path_factory, models["qwen35"], *ARGS, "--slot-save-path", str(slot_dir))


@pytest.fixture(scope="module")
def live(
    tmp_path_factory: pytest.TempPathFactory, models: dict[str, Path], slot_dir: Path
) -> Iterator[EngineProcess]:
    yield from _engine(tmp_path_factory, models, slot_dir)


@pytest.fixture(scope="module")
def other(
    tmp_path_factory: pytest.TempPathFactory, models: dict[str, Path], slot_dir: Path
) -> Iterator[EngineProcess]:
    yield from _engine(tmp_path_factory, models, slot_dir)


def _chat(c: httpx.Client, messages: list[dict[str, Any]], slot: int, **extra: Any) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "id_slot": slot, **extra}
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _post(c: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_a_long_session_stores_a_bounded_ladder_and_restores_exactly(
    live: EngineProcess, other: EngineProcess, slot_dir: Path
) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    with (
        httpx.Client(base_url=live.url, timeout=120.0) as a,
        httpx.Client(base_url=other.url, timeout=120.0) as b,
    ):
        for turn in range(14):
            tool_output = f"step {turn}: " + "compiled module ok; tests passed; " * (3 + turn % 4)
            messages.append({"role": "user", "content": tool_output + "What next?"})
            answer = _chat(a, messages, 0)
            messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
            saved = _post(a, "/slots/0?action=save", {"filename": "session.slot"})
            stored = read_slot_file(slot_dir / "session.slot").checkpoints
            assert saved["n_checkpoints"] == len(stored) <= STORED, (turn, saved)
        live_slot = a.get("/slots").json()[0]
        assert live_slot["n_checkpoints"] > STORED  # the live slot keeps its own, larger ladder
        ladder = [c.n_tokens for c in stored]
        assert ladder[-1] >= live_slot["n_tokens"] - 64  # the newest: where the next turn goes on

        # The next turn, live on `a` and restored on `b`: the same tokens for the same work.
        nxt = messages + [{"role": "user", "content": "step 14: all green. Summarise."}]
        _post(b, "/slots/0?action=restore", {"filename": "session.slot"})
        want, got = _chat(a, nxt, 0), _chat(b, nxt, 0)
        assert got["choices"][0]["message"] == want["choices"][0]["message"]
        assert got["timings"]["prompt_n"] == want["timings"]["prompt_n"]
        assert got["timings"]["cache_n"] >= ladder[-1]

        # A branch that leaves the conversation early (an edited third message): restored, it rolls
        # back to a stored checkpoint before the edit; its answer is a cold run's.
        branch = messages[:3] + [{"role": "user", "content": "Start over with a clean build."}]
        _post(b, "/slots/0?action=restore", {"filename": "session.slot"})
        restored = _chat(b, branch, 0)
        cold = _chat(a, branch, 1, cache_prompt=False)
        assert restored["choices"][0]["message"] == cold["choices"][0]["message"]
        assert restored["slotkeeper"]["reuse"] == "checkpoint" and restored["timings"]["cache_n"] > 0
        assert restored["timings"]["prompt_n"] < cold["timings"]["prompt_n"]

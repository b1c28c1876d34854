"""A long agent session through `slotkeeper serve` stored in content-addressed chunks: what a turn
writes follows its new tokens, what the store holds follows the session, and restores stay exact
after the whole process is SIGKILLed."""

from __future__ import annotations

import signal
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.bench.harness.served import ServedStore

from .conftest import eventually, openai_client

MODEL = "qwen35-seed0"
SESSION = "agent-20"
# About 2,600 tokens of system prompt and tools: a turn (a short user message and an 8-token
# answer) then adds well under 10 % of the session.
SYSTEM = (
    "You are a coding agent with tools: read_file(path), write_file(path, text), run(cmd). "
    "Plan, act, check the result, and report briefly. "
) * 60
TURNS = 20


def _written(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith('slotkeeper_gateway_store_written_bytes_total{why="after-turn"}'):
            return float(line.split()[-1])
    return 0.0


def _generation(url: str) -> int:
    return int(httpx.get(f"{url}/v1/sessions/{SESSION}", timeout=5).json().get("generation", 0))


def _conversation(
    serve: Any, where: ServedStore, kill_every: int = 0
) -> tuple[list[tuple[str, int]], list[dict]]:
    """TURNS turns of one session; with ``kill_every`` the whole serve process is SIGKILLed after
    every that many turns (once the turn is durable) and started again on the same data."""
    s = serve(where.data, slots=1, args=("--ctx", "8192", *where.flags()), env=where.env())
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    answers, measured = [], []
    for turn in range(TURNS):
        msgs.append({"role": "user", "content": f"Step {turn}: run the tests and fix what fails."})
        before = _written(s.url)
        raw = openai_client(s.url, timeout=120).chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, max_tokens=8, temperature=0, extra_headers={"X-Session-Id": SESSION}
        )
        done = raw.parse()
        answer, timings = done.choices[0].message.content or "", done.model_extra["timings"]
        answers.append((answer, int(timings["prompt_n"])))
        msgs.append({"role": "assistant", "content": answer})
        eventually(f"turn {turn} durable", lambda t=turn, u=s.url: _generation(u) >= t + 1)
        if kill_every == 0:
            full = int(where.newest(SESSION)[1]["plan"]["size"])
            written = _written(s.url) - before
            # the superseded generation's garbage goes right after the save (no listing needed)
            eventually("storage follows the session", lambda f=full: where.stored_bytes() <= 1.5 * f)
            measured.append(
                {
                    "turn": turn,
                    "tokens": done.usage.prompt_tokens,
                    "full": full,
                    "written": written,
                    "stored": where.stored_bytes(),
                }
            )
        elif (turn + 1) % kill_every == 0 and turn + 1 < TURNS:
            s.stop(signal.SIGKILL)
            s = serve(where.data, slots=1, args=("--ctx", "8192", *where.flags()), env=where.env())
    return answers, measured


@pytest.mark.parametrize("store", ["local", "seaweedfs"])
def test_twenty_turns_write_what_is_new_and_restore_exactly_after_sigkill(
    serve: Any, tmp_path: Path, store: str, request: pytest.FixtureRequest
) -> None:
    endpoint = request.getfixturevalue("seaweed_server") if store == "seaweedfs" else None
    run = uuid.uuid4().hex[:8]
    steady, measured = _conversation(serve, ServedStore(tmp_path / "steady", f"steady{run}", endpoint))
    for m in measured:
        assert m["stored"] <= 1.5 * m["full"], m
    # Every turn after the first adds under 10 % of the session's tokens: it writes at most 0.35x.
    small = [
        m
        for prev, m in zip(measured, measured[1:], strict=False)
        if m["tokens"] - prev["tokens"] <= 0.1 * m["tokens"]
    ]
    assert len(small) >= TURNS - 2
    for m in small:
        assert m["written"] <= 0.35 * m["full"], m
    print("\nturn tokens full written stored")  # the numbers for the note (pytest -s)
    for m in measured:
        print(
            m["turn"],
            m["tokens"],
            m["full"],
            int(m["written"]),
            m["stored"],
            f"{m['written'] / m['full']:.3f} {m['stored'] / m['full']:.3f}",
        )

    killed = ServedStore(tmp_path / "killed", f"killed{run}", endpoint)
    restarted, _ = _conversation(serve, killed, kill_every=4)
    assert restarted == steady  # same answers and the same prompt_n, turn by turn

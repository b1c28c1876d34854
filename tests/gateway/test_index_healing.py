"""The index lost under live sessions: a real redis-server SIGKILLed and back empty, or FLUSHALLed.

`slotkeeper serve` runs against it with 8 sessions in 8 slots. The sessions' states are still in the
engine's slots, the node's spill cache and the store; only the index is gone. The gateway notices
(the index's epoch), rebuilds the index from the store, and the next turn of every session reuses
its whole stored conversation instead of re-prefilling it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx
import openai
import pytest

from gateway.bench.harness.servers import RedisProcess, eventually

from .conftest import openai_client

T = TypeVar("T")
MODEL = "qwen35-seed0"
SESSIONS = [f"agent-{i}" for i in range(8)]
SYSTEM = "You are a coding agent. Read files, run tests, fix bugs, and report briefly. " * 4


def turn(client: openai.OpenAI, session: str, messages: list[dict]) -> tuple[str, str, int, int]:
    """One greedy turn: the answer, the cache header, the tokens reused and the prompt's tokens."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        extra_headers={"X-Session-Id": session},
    )
    done = raw.parse()
    assert done.usage is not None
    return (
        done.choices[0].message.content or "",
        raw.headers["x-slotkeeper-cache"],
        done.model_extra["timings"]["cache_n"],
        done.usage.prompt_tokens,
    )


def two_turns(client: openai.OpenAI, convs: dict[str, list[dict]]) -> dict[str, int]:
    """Two turns of each conversation, the second on its live slot; for each, the tokens that
    second turn prefilled (its new message: what a turn that reuses the whole prefix costs)."""
    live_gap: dict[str, int] = {}
    for step in range(2):
        for sid, msgs in convs.items():
            msgs.append({"role": "user", "content": f"Step {step}: continue."})
            answer, cache, reused, prompt = turn(client, sid, msgs)
            if step == 1:
                assert cache == "live", (sid, cache)
                live_gap[sid] = prompt - reused
            msgs.append({"role": "assistant", "content": answer})
    return live_gap


def retried(call: Callable[[], T], deadline: float) -> T:
    """``call()``, retried on 503 + Retry-After as the agents' clients do, until ``deadline``: the
    node registers its engines again within a heartbeat of Redis coming back."""
    while True:
        try:
            return call()
        except openai.APIStatusError as exc:
            if exc.status_code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(min(float(exc.response.headers.get("retry-after", "1")), 1.0))


def saved(url: str, session: str) -> bool:
    """Whether the session's newest state is in the store (a turn's save may give way to the next
    turn's: one save can follow two turns)."""
    r = httpx.get(f"{url}/v1/sessions/{session}", timeout=10)
    record = r.json() if r.status_code == 200 else {}
    return int(record.get("generation", 0)) >= 1 and record.get("dirty") is False


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("loss", ["sigkill", "flushall"])
def test_every_session_reuses_its_prefix_after_the_index_is_lost(
    serve, restartable_redis: RedisProcess, tmp_path: Path, loss: str
):
    redis = restartable_redis
    s = serve(tmp_path / "data", slots=len(SESSIONS), args=["--redis-url", redis.url, "--log-level", "info"])
    client = openai_client(s.url)
    convs = {sid: [{"role": "system", "content": SYSTEM + f" You are agent {sid}."}] for sid in SESSIONS}
    live_gap = two_turns(client, convs)
    # Every session's second turn is in the store (a write-behind save), as the index says.
    for sid in SESSIONS:
        try:
            eventually(f"{sid}'s save", lambda sid=sid: saved(s.url, sid), timeout_s=60)
        except TimeoutError:
            record = httpx.get(f"{s.url}/v1/sessions/{sid}", timeout=10).text
            raise AssertionError(f"{sid} not saved: {record}\n{s.log.read_text()[-6000:]}") from None

    rebuilds = metric(s.url, "slotkeeper_gateway_index_rebuilds_total")  # the start-up's: the index was new
    if loss == "sigkill":
        redis.kill()
        down = httpx.post(
            s.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": convs[SESSIONS[0]] + [{"role": "user", "content": "?"}]},
            headers={"X-Session-Id": SESSIONS[0]},
            timeout=30,
        )
        assert down.status_code == 503 and down.headers["retry-after"], down.text
        redis.start()  # back on the same port, empty
    else:
        assert redis.command("FLUSHALL") == b"+OK"
    back = time.monotonic()

    for sid, msgs in convs.items():  # within 30 s of Redis coming back (the retries' deadline)
        msgs.append({"role": "user", "content": "Step 2: continue."})
        _, cache, reused, prompt = retried(lambda sid=sid, msgs=msgs: turn(client, sid, msgs), back + 30)
        # The whole conversation before this step was reused: only the new user message is
        # prefilled, as on the live slot the turn before.
        assert cache in ("live", "restored"), (sid, cache)
        assert prompt - reused <= live_gap[sid], (sid, cache, reused, prompt, live_gap[sid])
    assert metric(s.url, "slotkeeper_gateway_index_rebuilds_total") == rebuilds + 1  # once, for the loss
    assert metric(s.url, "slotkeeper_gateway_restores_reprefilled_total") == 0
    # The rebuilt index lists every session again, at its stored generation or a newer one.
    listed = {d["id"] for d in httpx.get(s.url + "/v1/sessions", timeout=10).json()["data"]}
    assert set(SESSIONS) <= listed


def test_sessions_never_saved_are_found_live_in_their_slots(
    serve, restartable_redis: RedisProcess, tmp_path: Path
) -> None:
    """An on-evict tenant's sessions are in no store: the rebuilt index finds them by the labels of
    the slots that hold them, and their next turns are served live there."""
    (tmp_path / "tenants.toml").write_text('[tenants.lazy]\nkeys = ["key-lazy"]\ndurability = "on-evict"\n')
    redis = restartable_redis
    s = serve(
        tmp_path / "data",
        slots=4,
        tenants=tmp_path / "tenants.toml",
        args=["--redis-url", redis.url, "--log-level", "info"],
    )
    client = openai_client(s.url, key="key-lazy")
    convs = {f"lazy-{i}": [{"role": "system", "content": SYSTEM + f" You are lazy-{i}."}] for i in range(4)}
    live_gap = two_turns(client, convs)
    auth = {"Authorization": "Bearer key-lazy"}
    for sid in convs:  # never saved: only the slot holds it
        record = httpx.get(f"{s.url}/v1/sessions/{sid}", headers=auth, timeout=10).json()
        assert int(record["generation"]) == 0

    assert redis.command("FLUSHALL") == b"+OK"
    back = time.monotonic()
    for sid, msgs in convs.items():
        msgs.append({"role": "user", "content": "Step 2: continue."})
        _, cache, reused, prompt = retried(lambda sid=sid, msgs=msgs: turn(client, sid, msgs), back + 30)
        assert cache == "live" and prompt - reused <= live_gap[sid], (sid, cache, reused, prompt)
    assert metric(s.url, "slotkeeper_gateway_index_live_adopted_total") == len(convs)

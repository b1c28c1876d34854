"""Records that place a session in a slot holding another's state, served right.

A stale record (an engine restarted under it, a race that left two sessions claiming one slot) says
a session is live in a slot whose state is someone else's. Served there "live", its turn would
re-prefill from nothing, and its write-behind save would store the other session's state under
its name. The engine knows better: every slot is labelled with the session its last turn ran for,
and a turn on its live slot names the session it expects there (`slot_expect`), as does every save
the gateway makes. A slot that says otherwise refuses both (409 slot_changed); the gateway records
the session as what it last stored and places the turn again, from its stored state.

Here a real redis-server's records of two live sessions are swapped behind `slotkeeper serve`'s
back, so each claims the other's slot.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import redis

from gateway.bench.harness.servers import RedisProcess, eventually

from .conftest import openai_client
from .test_index_healing import SYSTEM, metric, retried, saved, turn, two_turns


def record(url: str, session: str) -> dict:
    r = httpx.get(f"{url}/v1/sessions/{session}", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_sessions_whose_records_swapped_slots_are_restored_not_reprefilled(
    serve, restartable_redis: RedisProcess, tmp_path: Path
) -> None:
    s = serve(tmp_path / "data", slots=2, args=["--redis-url", restartable_redis.url, "--log-level", "info"])
    client = openai_client(s.url)
    convs = {sid: [{"role": "system", "content": SYSTEM + f" You are agent {sid}."}] for sid in ("a", "b")}
    live_gap = two_turns(client, convs)
    for sid in convs:
        eventually(f"{sid}'s save", lambda sid=sid: saved(s.url, sid), timeout_s=60)
    a, b = record(s.url, "a"), record(s.url, "b")
    assert a["state"] == b["state"] == "live" and a["engine"] == b["engine"] and a["slot"] != b["slot"]

    with redis.Redis.from_url(restartable_redis.url) as r:
        keys = {sid: next(iter(r.scan_iter(match=f"slotkeeper:{{t:*}}:s:{sid}"))) for sid in convs}

        def swap(dirty: bool) -> None:
            """Each record names the other's slot (and says it holds more than it stored, `dirty`)."""
            a, b = record(s.url, "a"), record(s.url, "b")
            assert a["state"] == b["state"] == "live" and a["slot"] != b["slot"]
            r.hset(keys["a"], mapping={"slot": b["slot"], "dirty": str(dirty)})
            r.hset(keys["b"], mapping={"slot": a["slot"], "dirty": str(dirty)})

        def next_turns(step: int) -> None:
            """a's and b's next turns: each restored from its stored state, reusing its whole
            conversation — never served "live" in a slot that holds the other's state."""
            for sid in ("a", "b"):
                msgs = convs[sid]
                msgs.append({"role": "user", "content": f"Step {step}: continue."})
                answer, cache, reused, prompt = retried(
                    lambda msgs=msgs, sid=sid: turn(client, sid, msgs), deadline
                )
                assert cache == "restored", (sid, cache, reused, prompt)
                assert prompt - reused <= live_gap[sid], (sid, reused, prompt, live_gap[sid])
                msgs.append({"role": "assistant", "content": answer})

        # Turns on their "live" slots: the engine refuses each (the slot's label names the other).
        deadline = time.monotonic() + 60
        swap(dirty=False)
        next_turns(2)
        assert metric(s.url, "slotkeeper_gateway_slot_changed_total") == 2
        for sid in convs:
            eventually(f"{sid}'s save", lambda sid=sid: saved(s.url, sid), timeout_s=60)

        # Evictions: a new session needs room, and the least recently used claimant's save names it
        # while the slot's label does not: nothing is saved under its name, its claim is dropped, and
        # the slot, cleared, is the new session's.
        swap(dirty=True)
        deadline = time.monotonic() + 60
        convs["c"] = [
            {"role": "system", "content": SYSTEM + " You are c."},
            {"role": "user", "content": "Go."},
        ]
        _, cache, _, _ = turn(client, "c", convs["c"])
        assert cache == "cold"
        assert metric(s.url, "slotkeeper_gateway_slot_changed_total") == 3
        next_turns(3)
    assert metric(s.url, "slotkeeper_gateway_restores_reprefilled_total") == 0

"""A DELETE that waited for its session's lock erases the slot the session is in *then*.

The session's lock may be held when the DELETE comes — by an eviction spilling it, say — and by the
time the DELETE gets the lock, the session may have left its slot and another session may have been
restored there. The slot it was in when the DELETE began is no longer its to erase.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import redis
import redis.asyncio as aioredis

from gateway.bench.harness.servers import RedisProcess, eventually
from storage.index.keyspace import Keyspace
from storage.index.session_index import SessionIndex

from ..conftest import openai_client
from ..test_index_healing import SYSTEM, saved, turn
from ..test_slot_fence import record


def test_a_delete_that_waited_for_the_lock_leaves_the_slot_its_session_left(
    serve, restartable_redis: RedisProcess, tmp_path: Path
) -> None:
    s = serve(tmp_path / "data", slots=1, args=["--redis-url", restartable_redis.url, "--log-level", "info"])
    client = openai_client(s.url)
    a = [{"role": "system", "content": SYSTEM + " You are a."}, {"role": "user", "content": "Go."}]
    answer, _, _, _ = turn(client, "a", a)
    eventually("a's save", lambda: saved(s.url, "a"), timeout_s=60)
    where = record(s.url, "a")
    assert where["state"] == "live" and where["slot"] == 0

    # The eviction's part, by hand: a's lock held, then a spilled out of its slot.
    lock = Keyspace().lock("default", "a")
    engine_log = tmp_path / "data" / "engines" / where["engine"] / "engine.log"

    def slot_calls() -> int:
        return engine_log.read_text().count('"path": "/slots/0"')

    with redis.Redis.from_url(restartable_redis.url) as r:
        assert r.set(lock, "an-eviction", px=60_000, nx=True)
        deleted: dict[str, httpx.Response] = {}
        deleting = threading.Thread(
            target=lambda: deleted.setdefault("a", httpx.delete(f"{s.url}/v1/sessions/a", timeout=60))
        )
        before = slot_calls()
        deleting.start()
        # It read the record (live in slot 0), found the lock held, asked the slot to stop any turn
        # on it, and waits for the lock now.
        eventually("the DELETE's cancel", lambda: slot_calls() > before, timeout_s=30)

        async def spill_a() -> None:
            client = aioredis.from_url(restartable_redis.url)
            try:
                index = SessionIndex(client)
                await index.transition("default", "a", index.decide_unplaced(where["engine"], 0))
            finally:
                await client.aclose()

        asyncio.run(spill_a())
        # b, new, is served in the slot a left.
        b = [{"role": "system", "content": SYSTEM + " You are b."}, {"role": "user", "content": "Go."}]
        answer, cache, _, _ = turn(client, "b", b)
        assert cache == "cold" and record(s.url, "b")["slot"] == 0
        b += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Go on."}]
        r.delete(lock)  # the eviction is over
        deleting.join(timeout=60)
    assert deleted["a"].status_code == 200, deleted["a"].text

    # b's state is still in its slot: its next turn goes on from it.
    _, cache, reused, prompt = turn(client, "b", b)
    assert cache == "live" and reused > 0.8 * prompt, (cache, reused, prompt)

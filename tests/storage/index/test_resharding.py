"""A tenant's hash slot moved to another shard while its sessions change: redis-py follows ASK and
MOVED (and TRYAGAIN while a script's keys are split between the two nodes), which costs retries,
never a lost or wrong write."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gateway.bench.harness.redis_topologies import redis_cluster
from storage.errors import StoreUnavailable
from storage.index.session_index import SessionIndex
from storage.index.topology import connect

SESSIONS = [f"s{i}" for i in range(40)]


async def test_a_slot_moved_under_writes_loses_none_of_them(tmp_path: Path) -> None:
    with redis_cluster(tmp_path / "cluster", replicas=0) as servers:
        client = connect(servers.url, decode_responses=True)
        index = SessionIndex(client, prefix="rs")
        try:
            for sid in SESSIONS:
                await index.create("acme", sid, model="m")
            home = servers.primary_of("rs:{t:acme}")
            to = next(p for p in servers.primary_ports() if p != home)
            done = threading.Event()
            tokens: dict[str, int] = {}

            refused = 0  # StoreUnavailable (a 503 + Retry-After): the caller retries, as agents do

            async def retried(step: Callable[[], Awaitable[Any]]) -> None:
                nonlocal refused
                while True:
                    try:
                        await step()
                        return
                    except StoreUnavailable:
                        refused += 1
                        await asyncio.sleep(0.01)

            async def writes() -> None:
                n = 0
                while not done.is_set():
                    sid = SESSIONS[n % len(SESSIONS)]
                    n += 1
                    live = {"engine": "e1", "slot": n % 4, "tokens": n}
                    await retried(lambda sid=sid, live=live: index.mark_live("acme", sid, **live))
                    await retried(lambda sid=sid, n=n: index.add_prefixes("acme", sid, [f"{n:032x}"]))
                    await retried(lambda sid=sid, n=n: index.mark_idle("acme", sid, tokens=n))
                    tokens[sid] = n
                    await asyncio.sleep(0)

            task = asyncio.create_task(writes())
            await asyncio.to_thread(servers.migrate_slot, "rs:{t:acme}", to, 3)
            done.set()
            await task
            assert servers.primary_of("rs:{t:acme}") == to
            for sid, n in tokens.items():  # every write that answered is there, on the new shard
                record = await index.get("acme", sid)
                assert record.live and record.tokens == n, (sid, record, n)
                assert await index.match_prefix("acme", [f"{n:032x}"]) == (f"{n:032x}", sid)
            assert sorted(await index.list_sessions("acme")) == sorted(SESSIONS)
            assert refused < 50, refused  # a few retries, not a storm of failures
        finally:
            await client.aclose()

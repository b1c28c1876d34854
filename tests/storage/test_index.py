"""storage.index on a real redis-server and on the in-process default (same tests, parametrized)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from storage.errors import Conflict, InvalidId, LockLost, NotFound, StoreUnavailable
from storage.index import SessionIndex, SessionRecord, SessionState
from storage.keyspace import text
from storage.locks import SessionLocks


@pytest.fixture
def index(redis_client: Any) -> SessionIndex:
    ticks = itertools.count(1000)
    return SessionIndex(redis_client, prefix="sk", clock=lambda: float(next(ticks)))


async def test_session_lifecycle(index: SessionIndex) -> None:
    rec = await index.create("acme", "s1", model="fp", tokens=3)
    assert rec.state is SessionState.NEW and (await index.get("acme", "s1")) == rec
    with pytest.raises(Conflict):
        await index.create("acme", "s1", model="fp")
    live = await index.mark_live("acme", "s1", engine="e1", slot=2, tokens=10)
    assert (live.state, live.engine, live.slot, live.tokens, live.model) == (
        SessionState.LIVE,
        "e1",
        2,
        10,
        "fp",
    )
    assert await index.engine_sessions("e1") == [("acme", "s1")]
    assert await index.idle_sessions("e1") == []  # busy
    await index.mark_idle("acme", "s1", tokens=20)
    assert await index.idle_sessions("e1") == [("acme", "s1")]
    await index.mark_busy("acme", "s1")
    assert await index.idle_sessions("e1") == []
    spilled = await index.mark_spilled("acme", "s1", generation=3, blob_key="k3", nbytes=99)
    assert (spilled.state, spilled.engine, spilled.slot, spilled.generation, spilled.tokens) == (
        SessionState.SPILLED,
        None,
        None,
        3,
        20,
    )
    assert await index.engine_sessions("e1") == [] and await index.idle_sessions("e1") == []
    with pytest.raises(Conflict):
        await index.mark_spilled("acme", "s1", generation=2, blob_key="k2", nbytes=1)
    with pytest.raises(Conflict):
        await index.mark_idle("acme", "s1")  # not live
    with pytest.raises(NotFound):
        await index.get("acme", "nope")
    with pytest.raises(NotFound):
        await index.mark_spilled("acme", "nope", generation=1, blob_key="k", nbytes=1)


async def test_idle_lru_order_and_engine_moves(index: SessionIndex) -> None:
    for s in ("a", "b", "c"):
        await index.mark_live("acme", s, engine="e1", slot=0, tokens=1, model="fp")
    for s in ("b", "a", "c"):
        await index.mark_idle("acme", s)
    assert await index.idle_sessions("e1") == [("acme", "b"), ("acme", "a"), ("acme", "c")]
    assert await index.idle_sessions("e1", limit=1) == [("acme", "b")]
    await index.mark_live("acme", "b", engine="e2", slot=1, tokens=2)
    assert await index.idle_sessions("e1") == [("acme", "a"), ("acme", "c")]
    assert await index.engine_sessions("e2") == [("acme", "b")]
    await index.set_durable("acme", "a", generation=4, blob_key="k4", nbytes=7)
    assert (await index.get("acme", "a")).state is SessionState.LIVE
    dropped = await index.drop_engine("e1")
    assert sorted(dropped) == [("acme", "a"), ("acme", "c")]
    assert (await index.get("acme", "a")).state is SessionState.SPILLED
    assert (await index.get("acme", "c")).state is SessionState.NEW
    assert await index.idle_sessions("e1") == [] and await index.engine_sessions("e1") == []


async def test_prefix_routing(index: SessionIndex) -> None:
    await index.create("acme", "s1", model="fp")
    await index.create("acme", "s2", model="fp")
    await index.add_prefixes("acme", "s1", ["a" * 16, "b" * 16])
    await index.add_prefixes("acme", "s2", ["c" * 16, "b" * 16])  # "b..." now routes to s2
    assert await index.match_prefix("acme", ["f" * 16, "c" * 16, "a" * 16]) == ("c" * 16, "s2")
    assert await index.match_prefix("acme", ["a" * 16]) == ("a" * 16, "s1")
    await index.delete("acme", "s1")
    assert await index.match_prefix("acme", ["a" * 16]) is None
    assert await index.match_prefix("acme", ["b" * 16]) == ("b" * 16, "s2")  # not taken down with s1
    assert await index.match_prefix("acme", []) is None
    for bad in ("XYZ", "abc", "g" * 16, "a" * 129):
        with pytest.raises(InvalidId):
            await index.match_prefix("acme", [bad])


async def test_delete_and_listing(index: SessionIndex) -> None:
    await index.mark_live("acme", "s1", engine="e1", slot=0, tokens=1, model="fp")
    await index.mark_idle("acme", "s1")
    await index.create("acme", "s2", model="fp")
    assert await index.list_sessions("acme") == ["s1", "s2"]
    await index.delete("acme", "s1")
    assert await index.list_sessions("acme") == ["s2"]
    assert await index.find("acme", "s1") is None
    assert await index.idle_sessions("e1") == [] and await index.engine_sessions("e1") == []


async def test_usage_counters(index: SessionIndex) -> None:
    await asyncio.gather(*(index.incr_usage("acme", {"prompt_tokens": 5, "requests": 1}) for _ in range(40)))
    assert await index.usage("acme") == {"prompt_tokens": 200, "requests": 40}
    assert await index.incr_usage("acme", {"requests": -1}) == {"requests": 39}
    assert await index.usage("other") == {}
    with pytest.raises(InvalidId):
        await index.incr_usage("acme", {"Bad-Name": 1})


async def test_concurrent_transitions_stay_consistent(index: SessionIndex) -> None:
    await index.mark_live("acme", "s", engine="e1", slot=0, tokens=0, model="fp")
    await asyncio.gather(*(index.mark_idle("acme", "s", tokens=i) for i in range(30)))
    record = await index.get("acme", "s")
    assert record.state is SessionState.LIVE and await index.idle_sessions("e1") == [("acme", "s")]


async def test_lock_fencing(index: SessionIndex, redis_client: Any) -> None:
    locks = SessionLocks(redis_client, prefix="sk")
    await index.create("acme", "s", model="fp")
    stale = await locks.acquire("acme", "s", ttl_s=0.2)
    await asyncio.sleep(0.35)
    fresh = await locks.acquire("acme", "s", ttl_s=5)
    with pytest.raises(LockLost):
        await index.mark_spilled("acme", "s", generation=1, blob_key="k", nbytes=1, lock=stale)
    assert (await index.get("acme", "s")).state is SessionState.NEW
    await index.mark_spilled("acme", "s", generation=1, blob_key="k", nbytes=1, lock=fresh)
    with pytest.raises(InvalidId):
        await index.mark_spilled("acme", "other", generation=1, blob_key="k", nbytes=1, lock=fresh)


async def test_restore_spilled(index: SessionIndex) -> None:
    rec = SessionRecord("acme", "s", SessionState.SPILLED, model="fp", tokens=9, generation=5, blob_key="k5")
    assert await index.restore_spilled(rec) is True
    assert await index.restore_spilled(rec) is False  # idempotent
    older = SessionRecord("acme", "s", SessionState.SPILLED, generation=4, blob_key="k4")
    assert await index.restore_spilled(older) is False
    await index.mark_live("acme", "s", engine="e1", slot=0, tokens=12)
    newer = SessionRecord("acme", "s", SessionState.SPILLED, generation=6, blob_key="k6", bytes=3)
    assert await index.restore_spilled(newer) is True
    got = await index.get("acme", "s")
    assert (got.state, got.generation, got.engine) == (SessionState.LIVE, 6, "e1")


async def test_tenant_scoping_and_key_names(index: SessionIndex, redis_client: Any) -> None:
    await index.mark_live("tenantA", "secret", engine="e1", slot=0, tokens=1, model="fp")
    await index.mark_idle("tenantA", "secret")
    await index.add_prefixes("tenantA", "secret", ["d" * 32])
    await index.incr_usage("tenantA", {"requests": 1})
    assert await index.find("tenantB", "secret") is None
    assert await index.list_sessions("tenantB") == []
    assert await index.match_prefix("tenantB", ["d" * 32]) is None
    with pytest.raises(NotFound):
        await index.mark_spilled("tenantB", "secret", generation=1, blob_key="k", nbytes=1)
    for bad in ("a/b", "..", "x\0y", "t" * 129, "a:b", ""):
        with pytest.raises(InvalidId):
            await index.find(bad, "s")
        with pytest.raises(InvalidId):
            await index.find("tenantA", bad)
    keys = sorted(text(k) for k in await redis_client.keys("*"))
    tenant_keys = [k for k in keys if not k.startswith("sk:e:")]
    assert keys and all(k.startswith("sk:") for k in keys)
    assert tenant_keys and all(k.startswith("sk:t:tenantA:") for k in tenant_keys), tenant_keys


async def test_redis_down_is_store_unavailable() -> None:
    client = aioredis.Redis(port=1, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    index = SessionIndex(client)
    with pytest.raises(StoreUnavailable):
        await index.find("acme", "s")
    with pytest.raises(StoreUnavailable):
        await index.create("acme", "s", model="fp")
    await client.aclose()


async def test_batched_reads_for_placement_snapshots(index: SessionIndex, redis_client: Any) -> None:
    from storage.locks import SessionLocks

    await index.mark_live("acme", "a", engine="e1", slot=0, tokens=1)
    await index.mark_live("acme", "b", engine="e2", slot=1, tokens=2)
    await index.mark_live("beta", "a", engine="e2", slot=0, tokens=3)
    live = await index.engines_sessions(["e1", "e2", "e3"])
    assert live == {"e1": [("acme", "a")], "e2": [("acme", "b"), ("beta", "a")], "e3": []}
    pairs = [("acme", "a"), ("beta", "a"), ("acme", "nope")]
    found = await index.find_many(pairs)
    assert [r.slot if r else None for r in found] == [0, 0, None]
    assert found[1] is not None and found[1].tenant == "beta" and found[1].tokens == 3
    locks = SessionLocks(redis_client, prefix=index.keys.prefix)
    held = await locks.try_acquire("beta", "a", ttl_s=30)
    assert held is not None
    assert await locks.owners(pairs) == [None, held.token, None]
    assert await index.find_many([]) == [] and await locks.owners([]) == []


async def test_is_idle_tells_a_running_turn_from_bookkeeping(index: SessionIndex) -> None:
    assert not await index.is_idle("acme", "x")
    await index.mark_live("acme", "x", engine="e1", slot=0, tokens=1)
    assert not await index.is_idle("acme", "x")  # a request runs on it
    await index.mark_idle("acme", "x", tokens=5, route="cd" * 16)
    assert await index.is_idle("acme", "x")
    assert (await index.get("acme", "x")).route == "cd" * 16
    await index.mark_busy("acme", "x")
    assert not await index.is_idle("acme", "x")
    await index.mark_spilled("acme", "x", generation=1, blob_key="k", nbytes=1)
    assert not await index.is_idle("acme", "x")


async def test_dirty_tracks_changes_since_the_durable_generation(index: SessionIndex) -> None:
    rec = await index.mark_live("acme", "d", engine="e1", slot=0, tokens=1)
    assert rec.dirty  # a turn runs: the slot will change
    await index.mark_idle("acme", "d", tokens=4)
    assert (await index.get("acme", "d")).dirty
    assert not (await index.set_durable("acme", "d", generation=1, blob_key="k1", nbytes=9)).dirty
    assert (await index.mark_busy("acme", "d")).dirty
    assert not (await index.mark_spilled("acme", "d", generation=2, blob_key="k2", nbytes=9)).dirty

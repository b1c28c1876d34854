"""Pool views cost the same whatever the pool's size: above `sample` engines a random sample
is looked at, plus, for a tenant at its live-slot quota, every engine holding one of its live
sessions (it makes room among them); the registry is read from the gateway's cache until its epoch
moves."""

from __future__ import annotations

import random

import fakeredis
import httpx
import pytest

from gateway.cluster import Cluster
from gateway.turn.slot_choice import SessionView, choose_placement
from storage.index.engines import EngineRegistry
from storage.index.session_index import SessionIndex

MODEL = "m"


@pytest.fixture
async def pool():
    redis = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    index, registry = SessionIndex(redis), EngineRegistry(redis)
    for e in range(40):
        await registry.register(f"e{e:02d}", node="n", url=f"http://e{e}", model=MODEL, n_slots=2, ttl_s=600)
    async with httpx.AsyncClient() as http:
        yield (
            index,
            registry,
            lambda sample: Cluster(registry, index, (), http, sample=sample, rng=random.Random(3)),
        )
    await redis.aclose()


async def _live(index: SessionIndex, tenant: str, session: str, engine: str, slot: int) -> None:
    await index.create(tenant, session, model=MODEL)
    await index.mark_live(tenant, session, engine=engine, slot=slot, tokens=1)
    await index.mark_idle(tenant, session)


async def test_a_large_pool_is_sampled_and_a_small_one_seen_whole(pool) -> None:
    index, _, cluster_of = pool
    whole, _ = await cluster_of(64).pool_view(MODEL)
    assert len(whole) == 40
    sampled, refs = await cluster_of(8).pool_view(MODEL)
    assert len(sampled) == 8 and set(refs) == {v.engine for v in sampled}
    cluster, seen = cluster_of(8), set()
    for _ in range(50):  # a different sample each time: every engine gets chosen eventually
        seen |= {v.engine for v in (await cluster.pool_view(MODEL))[0]}
    assert len(seen) == 40


async def test_the_tenants_own_engines_join_the_sample_so_its_live_quota_holds(pool) -> None:
    index, _, cluster_of = pool
    await _live(index, "t", "a", "e07", 0)
    await _live(index, "t", "b", "e31", 1)
    await _live(index, "other", "c", "e12", 0)
    cluster = cluster_of(4)
    views, _ = await cluster.pool_view(MODEL, holder=("t", "new"), live_limit=2)
    engines = {v.engine for v in views}
    assert {"e07", "e31"} <= engines and len(engines) <= 6
    # With a quota of 2 the tenant makes room by evicting its own least recently used session,
    # although that engine was not in the random part of the sample.
    placement = choose_placement(views, MODEL, SessionView("t", "new"), live_limit=2)
    assert placement.evict is not None and (placement.evict.tenant, placement.evict.session) == ("t", "a")
    # Below its quota (its own session not counted) the tenant takes a slot like any other: the
    # sample alone is read, however many live sessions it holds.
    for holder, limit in ((("t", "new"), 3), (("t", "a"), 2)):
        views, _ = await cluster.pool_view(MODEL, holder=holder, live_limit=limit)
        assert len(views) == 4
    # Spilled or deleted, a session leaves the tenant's live sessions.
    await index.mark_spilled("t", "a", generation=1, blob_key="k", nbytes=1)
    await index.delete("t", "b")
    assert await index.tenant_live_sessions("t") == {}
    assert await index.tenant_live_sessions("other") == {"c": "e12"}


async def test_the_registry_is_cached_until_its_epoch_moves(pool) -> None:
    index, registry, cluster_of = pool
    cluster = cluster_of(64)
    assert len(await cluster.engines(MODEL)) == 40
    await registry.unregister("e00")
    assert len(await cluster.engines(MODEL)) == 40  # cached: no round trip per turn
    cluster.saw_epoch(await registry.epoch())  # what a turn's opening read returns
    assert len(await cluster.engines(MODEL)) == 39
    await registry.register("e99", node="n", url="http://e99", model=MODEL, n_slots=2, ttl_s=600)
    assert len(await cluster.engines(MODEL, fresh=True)) == 40

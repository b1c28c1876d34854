"""The routing bench's population (gateway.bench.harness.fleet): every session, whether written by a
pipeline or by the script inside Redis, reads back through the index as the gateway would see it,
on the in-process index, one redis-server and a Redis Cluster."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from support.redis_topology import topology

from gateway.bench.harness.fleet import Fleet, build_fleet, load_fleet
from gateway.turn.prompt import lookup_digests
from storage.index.keyspace import in_process_redis, member, text
from storage.index.prefix_digests import ROUTE
from storage.index.session_index import SessionIndex
from storage.index.topology import connect


def _fleet() -> Fleet:
    # 3 tenants, 10 live sessions (5 engines x 2 slots), 3 turns of which the index keeps 2
    return build_fleet(301, tenants=3, engines=5, slots=2, turns=3, routes_per_session=2, request_pool=25)


async def _check(redis: Any, fleet: Fleet, real: bool) -> None:
    await load_fleet(redis, fleet, batch=7, scripted=13)  # many calls, uneven last ones
    index = SessionIndex(redis)
    keys = index.keys
    scripted = [i for i in range(fleet.n_sessions) if i not in fleet.digests]
    digest_length = len(fleet.digests[0][0])
    assert scripted and len(scripted) > fleet.n_sessions // 2
    for i in range(fleet.n_sessions):
        tenant, session = fleet.session(i)
        found = await index.find(tenant, session)
        assert found is not None and found.to_hash() == fleet.record(i).to_hash(), i
        assert await redis.zscore(keys.sessions(tenant), session) == fleet.record(i).last_used
        routes = await redis.zrange(keys.session_prefixes(tenant, session), 0, -1)
        assert len(routes) == fleet.kept and all(r.startswith(ROUTE) for r in routes)
        assert all(len(r) == len(ROUTE) + digest_length for r in routes)  # the bytes a true one takes
        for r in routes:
            assert await redis.get(keys.prefix_hash(tenant, r[len(ROUTE) :])) == session
        if i in fleet.digests:
            assert routes == [ROUTE + d for d in fleet.digests[i][-fleet.kept :]]
    for e, engine in enumerate(fleet.engines):  # the live ones, in their engines' sets
        expect = {member(*fleet.session(i)) for i in range(e * fleet.slots, (e + 1) * fleet.slots)}
        assert {text(m) for m in await redis.smembers(keys.engine_live(engine))} == expect
    for messages, owner in zip(fleet.requests, fleet.request_owner, strict=True):
        tenant, session = fleet.session(owner)
        hit = await index.match_prefix(tenant, lookup_digests(messages, fleet.model))
        assert hit is not None and hit[1] == session
    listed = sum([await redis.zcard(keys.sessions(t)) for t in fleet.tenants])
    assert listed == fleet.n_sessions
    if real:  # a scripted session takes the bytes a pipelined one does
        pipelined = next(i for i in fleet.digests if i >= fleet.n_live)
        sizes = []
        for i in (pipelined, scripted[-1]):
            tenant, session = fleet.session(i)
            sizes.append(await redis.memory_usage(keys.session(tenant, session)))
        assert sizes[0] == sizes[1]


def test_in_process() -> None:
    async def main() -> None:
        redis = in_process_redis()
        try:
            await _check(redis, _fleet(), real=False)
        finally:
            await redis.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("name", ["standalone", "cluster"])
def test_real_servers(request: pytest.FixtureRequest, name: str) -> None:
    url = topology(request, name).url

    async def main() -> None:
        redis = connect(url, decode_responses=True)
        try:
            await _check(redis, _fleet(), real=True)
        finally:
            await redis.aclose()

    asyncio.run(main())

"""storage.index.usage (through SessionIndex): windowed counters that expire, in-flight admission."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from storage.errors import InvalidId
from storage.index.keyspace import text
from storage.index.session_index import SessionIndex


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def tenant_keys(redis: Any, index: SessionIndex, tenant: str, part: str) -> dict[str, int]:
    keys = [text(k) async for k in redis.scan_iter(match=f"{index.keys.tenant(tenant)}:{part}*")]
    return {k: await redis.pttl(k) for k in keys}


# ------------------------------------------------------------------------------------------- windows
async def test_window_counts_reset_each_window_and_keys_expire(redis_client: Any) -> None:
    clock = Clock(1_700_000_020.0)  # 40 s into a minute
    index = SessionIndex(redis_client, prefix="sk", clock=clock)
    assert [await index.incr_window("acme", "rpm", 60) for _ in range(3)] == [1, 2, 3]
    assert await index.incr_window("acme", "rpm", 60, by=5) == 8
    assert await index.window_count("acme", "rpm", 60) == 8
    assert await index.window_count("beta", "rpm", 60) == 0
    ttls = await tenant_keys(redis_client, index, "acme", "w:")
    # the window ends in 20 s; its key stays one more window, then goes
    assert len(ttls) == 1 and 79_000 < next(iter(ttls.values())) <= 80_000, ttls
    clock.now += 20  # the next minute
    assert await index.incr_window("acme", "rpm", 60) == 1
    assert await index.window_count("acme", "rpm", 60) == 1
    assert await index.incr_window("acme", "tpm", 60, by=100) == 100  # counters are independent
    assert await index.incr_window("acme", "rpm", 3600) == 1  # and so are window lengths
    with pytest.raises(InvalidId):
        await index.incr_window("acme", "Bad-Name", 60)
    for bad in (0, -1, float("inf")):
        with pytest.raises(ValueError):
            await index.incr_window("acme", "rpm", bad)


async def test_window_keys_really_expire(redis_client: Any, eventually: Any) -> None:
    index = SessionIndex(redis_client, prefix="sk")
    await index.incr_window("acme", "rps", 0.05)

    async def gone() -> bool:
        return not await tenant_keys(redis_client, index, "acme", "w:")

    await eventually(gone, "a window's key expires one window after the window")
    await index.incr_usage("acme", {"requests": 1})  # lifetime counters never expire
    assert await redis_client.pttl(index.keys.usage("acme")) == -1


async def test_concurrent_window_increments_are_all_counted(redis_client: Any) -> None:
    index = SessionIndex(redis_client, prefix="sk", clock=Clock())
    values = await asyncio.gather(*(index.incr_window("acme", "rpm", 60) for _ in range(50)))
    assert sorted(values) == list(range(1, 51))


# ----------------------------------------------------------------------------------------- in flight
async def test_inflight_admits_up_to_the_limit_and_releases(redis_client: Any) -> None:
    index = SessionIndex(redis_client, prefix="sk")
    tokens = [await index.acquire_inflight("acme", 3, ttl_s=60) for _ in range(3)]
    assert all(tokens) and len(set(tokens)) == 3
    assert await index.acquire_inflight("acme", 3, ttl_s=60) is None
    assert await index.inflight_count("acme") == 3  # the refused attempt left nothing behind
    assert await index.acquire_inflight("beta", 1, ttl_s=60) is not None  # per tenant
    token = tokens[0]
    assert token is not None
    await index.release_inflight("acme", token)
    await index.release_inflight("acme", token)  # idempotent
    assert await index.inflight_count("acme") == 2
    assert await index.acquire_inflight("acme", 3, ttl_s=60) is not None
    with pytest.raises(InvalidId):
        await index.release_inflight("acme", "not-a-token")
    for bad in (0, -1, True):
        with pytest.raises(ValueError):
            await index.acquire_inflight("acme", bad, ttl_s=60)
    with pytest.raises(ValueError):
        await index.acquire_inflight("acme", 1, ttl_s=0)


async def test_concurrent_acquires_never_exceed_the_limit(redis_client: Any) -> None:
    index = SessionIndex(redis_client, prefix="sk")
    for _ in range(5):
        got = await asyncio.gather(*(index.acquire_inflight("acme", 4, ttl_s=60) for _ in range(25)))
        admitted = [t for t in got if t is not None]
        assert 1 <= len(admitted) <= 4
        assert await index.inflight_count("acme") == len(admitted)
        for token in admitted:
            await index.release_inflight("acme", token)
        assert await index.inflight_count("acme") == 0


async def test_places_of_a_dead_gateway_lapse(redis_client: Any, eventually: Any) -> None:
    clock = Clock()
    index = SessionIndex(redis_client, prefix="sk", clock=clock)
    assert await index.acquire_inflight("acme", 2, ttl_s=30) is not None  # this holder "dies"
    assert await index.acquire_inflight("acme", 2, ttl_s=60) is not None
    assert await index.acquire_inflight("acme", 2, ttl_s=60) is None
    clock.now += 31  # the first place lapses: pruned by the next acquire
    assert await index.acquire_inflight("acme", 2, ttl_s=60) is not None
    assert await index.inflight_count("acme") == 2
    assert 59_000 < await redis_client.pttl(index.keys.inflight("acme")) <= 60_000  # the longest TTL

    real = SessionIndex(redis_client, prefix="sk2")  # the key goes too once every holder is gone
    assert await real.acquire_inflight("acme", 1, ttl_s=0.05) is not None

    async def gone() -> bool:
        return not await redis_client.exists(real.keys.inflight("acme"))

    await eventually(gone, "the in-flight key expires with its newest place")

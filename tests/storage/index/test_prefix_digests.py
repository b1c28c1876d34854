"""storage.index.prefix_digests (through SessionIndex): implicit routes expire unless the session
re-adds them."""

from __future__ import annotations

from typing import Any

import pytest

from storage.errors import InvalidId
from storage.index.keyspace import text
from storage.index.session_index import SessionIndex

A, B, C = "a" * 16, "b" * 16, "c" * 32


async def route_ttls(redis: Any, index: SessionIndex, tenant: str) -> dict[str, int]:
    """PTTL of every routing key of the tenant (``px`` digests and ``sx`` sets)."""
    keys = [text(k) async for k in redis.scan_iter(match=f"{index.keys.tenant(tenant)}:*")]
    return {k: await redis.pttl(k) for k in keys if ":px:" in k or ":sx:" in k}


async def test_every_routing_key_has_the_ttl(redis_client: Any) -> None:
    index = SessionIndex(redis_client, prefix="sk", route_ttl_s=60)
    await index.create("acme", "s1", model="fp")
    await index.add_prefixes("acme", "s1", [A, B])
    ttls = await route_ttls(redis_client, index, "acme")
    assert len(ttls) == 3 and all(55_000 < t <= 60_000 for t in ttls.values()), ttls
    default = SessionIndex(redis_client, prefix="sk")
    await default.add_prefixes("acme", "s1", [C])
    assert 6.9 * 86400_000 < await redis_client.pttl(default.keys.prefix_hash("acme", C)) <= 7 * 86400_000
    with pytest.raises(ValueError):
        SessionIndex(redis_client, route_ttl_s=0)


async def test_adding_again_refreshes_the_session_routes(redis_client: Any) -> None:
    index = SessionIndex(redis_client, prefix="sk", route_ttl_s=60)
    await index.create("acme", "s1", model="fp")
    await index.add_prefixes("acme", "s1", [A])
    for key in await route_ttls(redis_client, index, "acme"):
        await redis_client.pexpire(key, 1000)  # most of the TTL has passed
    await index.add_prefixes("acme", "s1", [A, B])  # the next turn records its history again
    ttls = await route_ttls(redis_client, index, "acme")
    assert len(ttls) == 3 and all(t > 55_000 for t in ttls.values()), ttls


async def test_unused_routes_lapse_and_take_their_keys_along(redis_client: Any, eventually: Any) -> None:
    index = SessionIndex(redis_client, prefix="sk", route_ttl_s=0.15)
    await index.create("acme", "s1", model="fp")
    await index.add_prefixes("acme", "s1", [A, B])
    assert await index.match_prefix("acme", [A]) == (A, "s1")

    async def gone() -> bool:
        return await index.match_prefix("acme", [B, A]) is None and not await route_ttls(
            redis_client, index, "acme"
        )

    await eventually(gone, "routes expire after route_ttl_s")
    assert await index.find("acme", "s1") is not None  # the session itself stays


async def test_match_skips_routes_of_deleted_sessions_in_one_batch(redis_client: Any) -> None:
    index = SessionIndex(redis_client, prefix="sk")
    for s in ("s1", "s2"):
        await index.create("acme", s, model="fp")
    await index.add_prefixes("acme", "s1", [A, B])
    await index.add_prefixes("acme", "s2", [C])
    await redis_client.delete(index.keys.session("acme", "s1"))  # record gone, route left behind
    assert await index.match_prefix("acme", [A, B, C]) == (C, "s2")
    assert await index.match_prefix("acme", ["d" * 16, "e" * 16]) is None
    await index.delete("acme", "s2")
    assert await index.match_prefix("acme", [C]) is None
    assert not [k for k in await route_ttls(redis_client, index, "acme") if "s2" in k or C in k]
    with pytest.raises(InvalidId):
        await index.add_prefixes("acme", "s1", ["NOT-HEX-0000000000"])
    with pytest.raises(InvalidId):
        await index.add_prefixes("acme", "a:b", [A])

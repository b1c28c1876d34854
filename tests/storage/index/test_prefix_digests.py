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


def _turn(n: int) -> tuple[list[str], str]:
    """What finishing turn ``n`` of one conversation records: the digests of its complete turns
    1..n and its head (oldest first), and its prompt's digest."""
    return [f"{t:032x}" for t in range(1, n + 1)] + [f"{0xAAAA0000 + n:032x}"], f"{0xBBBB0000 + n:032x}"


async def session_routing(redis: Any, index: SessionIndex, tenant: str) -> tuple[int, int]:
    """How many routing keys (``px``, ``pp`` and the ``sx`` set) the tenant has, and the bytes they
    name and hold (key names, values, the set's members)."""
    keys = [text(k) async for k in redis.scan_iter(match=f"{index.keys.tenant(tenant)}:*")]
    size = 0
    for key in keys:
        if ":sx:" in key:
            size += len(key) + sum(len(text(m)) for m in await redis.zrange(key, 0, -1))
        elif ":px:" in key or ":pp:" in key:
            size += len(key) + len(text(await redis.get(key)))
    return len([k for k in keys if ":px:" in k or ":pp:" in k or ":sx:" in k]), size


async def test_a_long_session_keeps_its_newest_routes_only(redis_client: Any) -> None:
    index = SessionIndex(redis_client, prefix="sk", routes_per_session=4)
    await index.create("acme", "s1", model="fp")
    sizes = []
    for n in range(1, 51):
        digests, prompt = _turn(n)
        await index.add_prefixes("acme", "s1", digests, prompt)
        sizes.append(await session_routing(redis_client, index, "acme"))
    assert sizes[3] == sizes[11] == sizes[49], sizes  # 4 keys and their set from the 4th turn on
    assert sizes[49][0] == 5
    last, prompt = _turn(50)
    # turn 51 is found by its last complete turn or its head, a retry of turn 50 by turn 49's route
    assert await index.match_prefix("acme", [last[-2], last[-1]]) == (last[-2], "s1")
    assert await index.match_prefix("acme", [last[-1]]) == (last[-1], "s1")
    assert await index.match_prefix("acme", [last[-3]]) == (last[-3], "s1")
    assert await index.find_shared("acme", prompt) is not None  # the last prompt, sent again
    # older branch points are no longer found: such a request starts a new session
    assert await index.match_prefix("acme", list(reversed(last[:-3]))) is None
    assert await index.find_shared("acme", _turn(49)[1]) is None
    await index.delete("acme", "s1")
    assert await session_routing(redis_client, index, "acme") == (0, 0)
    with pytest.raises(ValueError):
        SessionIndex(redis_client, routes_per_session=1)


async def test_dropping_a_route_keeps_it_for_the_session_it_was_repointed_to(redis_client: Any) -> None:
    index = SessionIndex(redis_client, prefix="sk", routes_per_session=2)
    for s in ("s1", "s2"):
        await index.create("acme", s, model="fp")
    await index.add_prefixes("acme", "s1", [A])
    await index.add_prefixes("acme", "s2", [A, B])  # a branch of s1's conversation: A is s2's now
    await index.add_prefixes("acme", "s1", [C, "d" * 16])  # s1 goes on and drops A
    assert await index.match_prefix("acme", [A]) == (A, "s2")
    assert await index.match_prefix("acme", [C]) == (C, "s1")


async def test_a_turns_routes_ride_its_guarded_write_bounded(redis_client: Any) -> None:
    index = SessionIndex(redis_client, prefix="sk", routes_per_session=3)
    record = await index.create("acme", "s1", model="fp")
    for n in range(1, 13):
        digests, prompt = _turn(n)

        def also(ops: Any, digests: list[str] = digests, prompt: str = prompt) -> None:
            index.queue_prefixes(ops, "acme", "s1", digests, prompt)

        written = await index.apply(record, lambda old: old, lock=None, also=also)
        assert written is not None
        record = written
        count, _ = await session_routing(redis_client, index, "acme")
        assert count == 1 + min(3, n + 2), (n, count)
    last, prompt = _turn(12)
    assert await index.match_prefix("acme", [last[-2]]) == (last[-2], "s1")
    assert await index.find_shared("acme", prompt) is not None

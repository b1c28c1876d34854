"""storage.index.shared_prefixes (through SessionIndex): a shared prefix's digest names the newest
session of the tenant that reached it, expires with the route TTL, never answers for another tenant, and a
deleted session is not found through it."""

from __future__ import annotations

from typing import Any

import pytest

from storage.errors import InvalidId
from storage.index.session_index import SessionIndex
from storage.index.turnops import Ops

D, E = "d" * 32, "e" * 32


async def test_the_newest_session_to_reach_a_prefix_is_found_with_its_record(redis_client: Any) -> None:
    index = SessionIndex(redis_client, prefix="sk", route_ttl_s=60)
    assert await index.find_shared("acme", D) is None
    for s in ("s1", "s2"):
        await index.create("acme", s, model="fp")
    await index.add_shared("acme", "s1", D)
    found = await index.find_shared("acme", D)
    assert found is not None and (found.tenant, found.session, found.model) == ("acme", "s1", "fp")
    await index.add_shared("acme", "s2", D)
    assert (await index.find_shared("acme", D)).session == "s2"  # type: ignore[union-attr]
    assert 55_000 < await redis_client.pttl(index.keys.shared_prefix("acme", D)) <= 60_000


async def test_never_across_tenants_and_never_a_deleted_session(redis_client: Any) -> None:
    index = SessionIndex(redis_client, prefix="sk")
    await index.create("acme", "s1", model="fp")
    await index.add_shared("acme", "s1", D)
    assert await index.find_shared("beta", D) is None  # the same digest under another tenant
    await index.create("beta", "s1", model="fp")  # even with a namesake session there
    assert await index.find_shared("beta", D) is None
    await index.delete("acme", "s1")
    assert await index.find_shared("acme", D) is None


async def test_it_rides_along_with_a_turns_bookkeeping(redis_client: Any) -> None:
    index = SessionIndex(redis_client, prefix="sk")
    rec = await index.create("acme", "s1", model="fp")

    def also(ops: Ops) -> None:
        index.queue_shared(ops, "acme", "s1", E)

    live = index.decide_live("acme", "s1", engine="e1", slot=0, tokens=10)
    assert await index.apply(rec, live, lock=None, idle=False, also=also) is not None
    assert (await index.find_shared("acme", E)).session == "s1"  # type: ignore[union-attr]


async def test_digests_and_ids_are_checked(redis_client: Any) -> None:
    index = SessionIndex(redis_client, prefix="sk")
    with pytest.raises(InvalidId):
        await index.find_shared("acme", "not-hex")
    with pytest.raises(InvalidId):
        await index.add_shared("acme", "a:b", D)

"""storage.index.session_index on a real redis-server and on the in-process default (same tests,
parametrized)."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot

from storage.errors import GenerationUsed, InvalidId, LockLost, NotStored, StoreUnavailable, WriteConflict
from storage.index.keyspace import text
from storage.index.locks import SessionLocks
from storage.index.session_index import SessionIndex, SessionRecord, SessionState
from storage.index.topology import is_cluster


@pytest.fixture
def index(redis_client: Any) -> SessionIndex:
    ticks = itertools.count(1000)
    return SessionIndex(redis_client, prefix="sk", clock=lambda: float(next(ticks)))


async def test_session_lifecycle(index: SessionIndex) -> None:
    rec = await index.create("acme", "s1", model="fp", tokens=3)
    assert rec.state is SessionState.NEW and (await index.get("acme", "s1")) == rec
    with pytest.raises(WriteConflict):
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
    with pytest.raises(WriteConflict):
        await index.mark_spilled("acme", "s1", generation=2, blob_key="k2", nbytes=1)
    with pytest.raises(WriteConflict):
        await index.mark_idle("acme", "s1")  # not live
    with pytest.raises(NotStored):
        await index.get("acme", "nope")
    with pytest.raises(NotStored):
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


async def test_a_dropped_engine_keeps_sessions_recorded_live_on_its_new_process(
    index: SessionIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    await index.mark_live("acme", "old", engine="e1", slot=0, tokens=1, model="fp")
    await index.mark_idle("acme", "old")
    stale = await index.engine_sessions("e1")
    # The restarted process serves a session after the drop listed the old ones.
    await index.mark_live("acme", "new", engine="e1", slot=1, tokens=1, model="fp")
    await index.mark_idle("acme", "new")

    async def listed_before(engine: str) -> list[tuple[str, str]]:
        return stale

    monkeypatch.setattr(index, "engine_sessions", listed_before)
    assert await index.drop_engine("e1") == [("acme", "old")]
    monkeypatch.undo()
    assert await index.engine_sessions("e1") == [("acme", "new")]  # still seen by pool views
    assert await index.idle_sessions("e1") == [("acme", "new")]


async def test_a_session_unplaced_from_its_slot_is_what_it_last_stored(index: SessionIndex) -> None:
    await index.mark_live("acme", "s", engine="e1", slot=2, tokens=9, model="fp")
    await index.set_durable("acme", "s", generation=3, blob_key="k3", nbytes=7)
    await index.mark_live("acme", "s", engine="e1", slot=2, tokens=12, model="fp")  # newer than stored
    assert (await index.get("acme", "s")).dirty
    # Another slot, or another engine: not this record's claim, left as it is.
    for engine, slot in (("e1", 1), ("e2", 2)):
        kept = await index.transition("acme", "s", index.decide_unplaced(engine, slot))
        assert (kept.state, kept.engine, kept.slot) == (SessionState.LIVE, "e1", 2)
    out = await index.transition("acme", "s", index.decide_unplaced("e1", 2))
    assert (out.state, out.engine, out.slot, out.generation, out.dirty) == (
        SessionState.SPILLED,
        None,
        None,
        3,
        False,
    )
    assert await index.engine_sessions("e1") == []
    await index.mark_live("acme", "n", engine="e1", slot=0, tokens=1, model="fp")  # never stored
    assert (await index.transition("acme", "n", index.decide_unplaced("e1"))).state is SessionState.NEW


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
    fresh = await locks.acquire("acme", "s", ttl_s=5, wait_s=5, poll_s=0.01)  # once the stale one lapsed
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


async def test_adopt_live_takes_a_slot_label_only_over_what_is_older(index: SessionIndex) -> None:
    # No record: the label's session is recorded live and idle in its slot, dirty (never saved).
    assert await index.adopt_live("acme", "s1", engine="e1", slot=2, tokens=300, model="m")
    got = await index.get("acme", "s1")
    assert (got.state, got.engine, got.slot, got.tokens, got.dirty) == (SessionState.LIVE, "e1", 2, 300, True)
    assert [s for _, s in await index.idle_sessions("e1")] == ["s1"]
    # Live already: the index is newer than any label.
    assert not await index.adopt_live("acme", "s1", engine="e2", slot=0, tokens=900, model="m")
    # Stored with fewer tokens than the slot holds: the slot is newer, live there.
    stored = SessionRecord("acme", "s2", SessionState.SPILLED, model="m", tokens=100, generation=3)
    assert await index.restore_spilled(stored)  # as the rebuild from the store found it
    assert await index.adopt_live("acme", "s2", engine="e1", slot=1, tokens=120, model="m")
    got = await index.get("acme", "s2")
    assert (got.state, got.slot, got.generation) == (SessionState.LIVE, 1, 3)  # its stored copy stays known
    # Stored with more tokens than the slot holds: a label older than the store's copy.
    assert await index.restore_spilled(replace(stored, session="s3", tokens=500))
    assert not await index.adopt_live("acme", "s3", engine="e1", slot=3, tokens=200, model="m")
    assert (await index.get("acme", "s3")).state is SessionState.SPILLED


async def test_tenant_scoping_and_key_names(index: SessionIndex, redis_client: Any) -> None:
    await index.mark_live("tenantA", "secret", engine="e1", slot=0, tokens=1, model="fp")
    await index.mark_idle("tenantA", "secret")
    await index.add_prefixes("tenantA", "secret", ["d" * 32])
    await index.incr_usage("tenantA", {"requests": 1})
    assert await index.find("tenantB", "secret") is None
    assert await index.list_sessions("tenantB") == []
    assert await index.match_prefix("tenantB", ["d" * 32]) is None
    with pytest.raises(NotStored):
        await index.mark_spilled("tenantB", "secret", generation=1, blob_key="k", nbytes=1)
    # ":" and braces too: an id can neither spell another tenant's key nor pick another hash slot
    for bad in ("a/b", "..", "x\0y", "t" * 129, "a:b", "", "{t:tenantB}", "a}b{"):
        with pytest.raises(InvalidId):
            await index.find(bad, "s")
        with pytest.raises(InvalidId):
            await index.find("tenantA", bad)
    keys = await all_keys(redis_client)
    tenant_keys = [k for k in keys if k.startswith("sk:{t:")]
    assert keys and all(k.startswith(("sk:{t:", "sk:{e:", "sk:{g}:")) for k in keys), keys
    assert tenant_keys and all(k.startswith("sk:{t:tenantA}:") for k in tenant_keys), tenant_keys
    assert len({key_slot(k.encode()) for k in tenant_keys}) == 1  # one hash slot: single-slot scripts


async def all_keys(redis: Any) -> list[str]:
    """Every key, of every primary of a cluster."""
    if is_cluster(redis):
        return sorted([text(k) async for k in redis.scan_iter("*")])
    return sorted(text(k) for k in await redis.keys("*"))


async def test_redis_down_is_store_unavailable() -> None:
    client = aioredis.Redis(port=1, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    index = SessionIndex(client)
    with pytest.raises(StoreUnavailable):
        await index.find("acme", "s")
    with pytest.raises(StoreUnavailable):
        await index.create("acme", "s", model="fp")
    await client.aclose()


async def test_one_script_reads_every_occupant_of_a_pool_view(index: SessionIndex) -> None:
    await index.mark_live("acme", "a", engine="e1", slot=0, tokens=1)
    await index.mark_live("acme", "b", engine="e2", slot=1, tokens=2)
    await index.mark_live("beta", "a", engine="e2", slot=0, tokens=3)
    await index.mark_idle("beta", "a")
    rows = await index.slot_occupants(["e1", "e2", "e3"])
    seen = {(engine, pair): (occ.slot if occ else None, idle) for engine, pair, occ, idle in rows}
    assert seen == {
        ("e1", ("acme", "a")): (0, False),
        ("e2", ("acme", "b")): (1, False),
        ("e2", ("beta", "a")): (0, True),
    }
    assert await index.slot_occupants([]) == []


async def test_a_pool_view_reads_locks_and_survives_servers_that_lost_their_scripts(
    index: SessionIndex, redis_client: Any
) -> None:
    """A shard restarted or promoted has no scripts cached: the next view loads them again
    (Redis Cluster reads by scripts of its own, one per engine and one per tenant)."""
    for n, tenant in enumerate(("acme", "beta", "gamma")):
        await index.mark_live(tenant, "s", engine=f"e{n % 2}", slot=n, tokens=1)
    await index.mark_idle("gamma", "s")
    locks = SessionLocks(redis_client, prefix="sk")
    lock = await locks.acquire("beta", "s", ttl_s=30)
    assert lock is not None

    async def seen() -> dict[tuple[str, tuple[str, str]], tuple[int | None, bool, bool]]:
        rows = await index.slot_occupants(["e0", "e1", "e9"])
        return {
            (engine, pair): (occ.slot if occ else None, occ is not None and occ.owner is not None, idle)
            for engine, pair, occ, idle in rows
        }

    expected = {
        ("e0", ("acme", "s")): (0, False, False),
        ("e1", ("beta", "s")): (1, True, False),
        ("e0", ("gamma", "s")): (2, False, True),
    }
    assert await seen() == expected
    await redis_client.script_flush()
    assert await seen() == expected


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


# ---------------------------------------------------------------------------- sessions and bytes
async def test_count_sessions_follows_creates_and_deletes(index: SessionIndex) -> None:
    assert await index.count_sessions("acme") == 0
    for s in ("a", "b", "c"):
        await index.create("acme", s, model="fp")
    await index.mark_live("acme", "d", engine="e1", slot=0, tokens=1)  # implicit create counts too
    await index.create("beta", "a", model="fp")
    await index.delete("acme", "b")
    await index.delete("acme", "never")
    assert await index.count_sessions("acme") == 3 and await index.count_sessions("beta") == 1


async def test_records_leave_the_stored_bytes_to_the_store(index: SessionIndex) -> None:
    """The counter is what the store holds (the chunk ledger and reindex set it): no transition of
    a record moves it, since shared chunks are not any one session's."""
    await index.mark_live("acme", "s1", engine="e1", slot=0, tokens=1)
    await index.set_durable("acme", "s1", generation=1, blob_key="k1", nbytes=100)
    await index.create("acme", "s2", model="fp")
    await index.mark_spilled("acme", "s2", generation=1, blob_key="k", nbytes=40)
    assert await index.stored_bytes("acme") == 0
    await index.set_stored_bytes("acme", 12345)
    await index.delete("acme", "s1")
    assert await index.stored_bytes("acme") == 12345 and await index.stored_bytes("beta") == 0
    await index.set_stored_bytes("acme", 7)
    assert await index.stored_bytes("acme") == 7


async def test_unused_since_lists_idle_sessions_oldest_first(index: SessionIndex) -> None:
    for s in ("a", "b", "c"):
        await index.create("acme", s, model="fp")
    records = {s: await index.get("acme", s) for s in ("a", "b", "c")}
    newest = max(r.last_used for r in records.values())
    found = await index.unused_since("acme", newest + 1)
    assert found == sorted(records, key=lambda s: records[s].last_used)
    assert await index.unused_since("acme", min(r.last_used for r in records.values()) - 1) == []
    assert await index.unused_since("beta", newest + 1) == []


# ------------------------------------------------------------------------------- reused session ids
async def test_a_reused_id_saves_above_every_generation_of_its_deleted_namesake(
    index: SessionIndex, redis_client: Any
) -> None:
    await index.create("acme", "s", model="fp")
    assert (await index.get("acme", "s")).next_generation == 1  # a fresh id starts at 1
    await index.mark_spilled("acme", "s", generation=3, blob_key="k3", nbytes=9)
    await index.delete("acme", "s")
    assert await index.generation_floor("acme", "s") == 3
    assert await index.generation_floor("beta", "s") == 0  # per tenant
    again = await index.create("acme", "s", model="fp")
    assert (again.generation, again.floor, again.next_generation) == (0, 3, 4)
    assert await redis_client.exists(index.keys.floor("acme", "s")) == 0  # the record carries it now
    for stale in (1, 3):
        with pytest.raises(GenerationUsed, match="deleted session"):
            await index.mark_spilled("acme", "s", generation=stale, blob_key="k", nbytes=1)
    await index.mark_spilled("acme", "s", generation=4, blob_key="k4", nbytes=1)
    assert (await index.get("acme", "s")).next_generation == 5
    await index.delete("acme", "s")
    live = await index.mark_live("acme", "s", engine="e1", slot=0, tokens=1)  # created implicitly
    assert live.floor == 4 and live.next_generation == 5
    with pytest.raises(WriteConflict):
        await index.set_durable("acme", "s", generation=2, blob_key="k", nbytes=1)


async def test_floor_from_the_caller_and_tombstone_lifetime(redis_client: Any, eventually: Any) -> None:
    index = SessionIndex(redis_client, prefix="sk", floor_ttl_s=0.2)
    rec = await index.create("acme", "x", model="fp", floor=7)  # e.g. the store still lists gen 7
    assert rec.next_generation == 8
    await index.delete("acme", "x")
    key = index.keys.floor("acme", "x")
    assert 0 < await redis_client.pttl(key) <= 200

    async def lapsed() -> bool:
        return await index.generation_floor("acme", "x") == 0

    await eventually(lapsed, "the floor's tombstone expires with floor_ttl_s")
    kept = SessionIndex(redis_client, prefix="sk", floor_ttl_s=None)
    await kept.create("acme", "y", model="fp", floor=2)
    await kept.delete("acme", "y")
    assert await redis_client.pttl(kept.keys.floor("acme", "y")) == -1  # kept until the id is reused
    await kept.delete("acme", "unknown")  # deleting a missing record leaves no tombstone
    assert await redis_client.exists(kept.keys.floor("acme", "unknown")) == 0
    with pytest.raises(ValueError):
        SessionIndex(redis_client, floor_ttl_s=0)


async def test_reindex_does_not_adopt_a_deleted_namesakes_leftover(index: SessionIndex) -> None:
    await index.create("acme", "s", model="fp")
    await index.mark_spilled("acme", "s", generation=2, blob_key="k2", nbytes=5)
    await index.delete("acme", "s")
    leftover = SessionRecord("acme", "s", SessionState.SPILLED, generation=2, blob_key="k2", bytes=5)
    assert await index.restore_spilled(leftover) is False
    assert await index.find("acme", "s") is None and await index.stored_bytes("acme") == 0
    newer = replace(leftover, generation=3, blob_key="k3")
    assert await index.restore_spilled(newer) is True
    assert (await index.get("acme", "s")).floor == 2
    newest = replace(leftover, generation=4, blob_key="k4")  # the record keeps its floor when replaced
    assert await index.restore_spilled(newest) is True
    got = await index.get("acme", "s")
    assert (got.generation, got.floor, got.next_generation) == (4, 2, 5)


async def test_reserved_generations_are_never_handed_out_twice(index: SessionIndex) -> None:
    with pytest.raises(NotStored):
        await index.reserve_generation("acme", "r")
    await index.create("acme", "r", model="fp")
    assert [await index.reserve_generation("acme", "r") for _ in range(2)] == [1, 2]
    await index.set_durable("acme", "r", generation=2, blob_key="k2", nbytes=3)  # 1's save failed
    got = await asyncio.gather(*(index.reserve_generation("acme", "r") for _ in range(5)))
    assert sorted(got) == [3, 4, 5, 6, 7]  # concurrent reservations stay distinct
    # 7 was handed out but its save's answer was lost: the index never recorded it as durable
    await index.delete("acme", "r")
    assert await index.generation_floor("acme", "r") == 7
    again = await index.create("acme", "r", model="fp")
    assert again.next_generation == 8 and await index.reserve_generation("acme", "r") == 8

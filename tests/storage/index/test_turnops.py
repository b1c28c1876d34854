"""storage.index.turnops: the opening read of a turn marks a session live in its slot busy there, exactly
as the transition it replaces would (on redis-server and in-process, parametrized)."""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from typing import Any

import pytest

from storage.index.locks import SessionLock, SessionLocks
from storage.index.session_index import SessionIndex, SessionState

START = {"lock_ttl_s": 30.0, "inflight_limit": 4, "inflight_ttl_s": 60.0}


@pytest.fixture
def index(redis_client: Any) -> SessionIndex:
    ticks = itertools.count(1000)
    return SessionIndex(redis_client, prefix="sk", clock=lambda: float(next(ticks)))


async def _idle_live(index: SessionIndex, session: str = "s", tenant: str = "acme") -> None:
    await index.create(tenant, session, model="m")
    await index.mark_live(tenant, session, engine="e1", slot=2, tokens=7, model="m")
    await index.mark_idle(tenant, session, tokens=9, route="ab" * 16)
    await index.set_durable(tenant, session, generation=1, blob_key="k1", nbytes=5)


async def test_a_live_session_is_marked_busy_in_its_slot_by_the_opening_read(index: SessionIndex) -> None:
    await _idle_live(index)
    before = await index.get("acme", "s")
    assert await index.is_idle("acme", "s") and not before.dirty
    start = await index.start_turn("acme", "s", **START)
    assert start.lock is not None and start.busy and not start.kept
    after = await index.get("acme", "s")
    assert start.record == after  # what the script returns is what Redis holds (a CAS base)
    # what placing it live in the same slot would have written, but for the moment of last use
    live = index.decide_live("acme", "s", engine="e1", slot=2, tokens=before.tokens, model="m")(before)
    assert after == replace(live, last_used=after.last_used)
    assert after.last_used > before.last_used and after.dirty
    assert not await index.is_idle("acme", "s")  # out of the idle LRU: never chosen for eviction
    rows = await index.slot_occupants(["e1"])
    seen = [(pair, occ.slot if occ else None, idle) for _, pair, occ, idle in rows]
    assert seen == [(("acme", "s"), 2, False)]
    assert await index.unused_since("acme", after.last_used + 1) == ["s"]  # the listing's score moved
    # the turn's end is a one-round-trip compare-and-set against the returned record
    done = await index.apply(start.record, index.decide_idle("s", tokens=12), lock=start.lock, idle=True)
    assert done is not None and done.tokens == 12 and await index.is_idle("acme", "s")


async def test_the_callers_own_lock_is_confirmed_not_taken(index: SessionIndex, redis_client: Any) -> None:
    await _idle_live(index)
    locks = SessionLocks(redis_client, prefix="sk")
    own = await locks.try_acquire("acme", "s", ttl_s=30)
    assert own is not None
    kept = await index.start_turn("acme", "s", own_lock=own, **START)
    assert kept.kept and kept.lock is None and kept.lock_left_s is None and kept.busy
    await index.apply(kept.record, index.decide_idle("s"), lock=own, idle=True)  # type: ignore[arg-type]

    stranger = SessionLock("acme", "s", "not-the-token", 30)
    other = await index.start_turn("acme", "s", own_lock=stranger, **START)
    assert not other.kept and other.lock is None and not other.busy
    assert other.lock_left_s is not None and 0 < other.lock_left_s <= 30
    assert await index.is_idle("acme", "s")  # someone else's lock: nothing marked
    with pytest.raises(ValueError):
        await index.start_turn("acme", "t", own_lock=own, **START)


async def test_nothing_is_marked_unless_the_session_is_live_and_locked_here(
    index: SessionIndex, redis_client: Any
) -> None:
    await index.create("acme", "new", model="m")
    start = await index.start_turn("acme", "new", **START)
    assert start.lock is not None and not start.busy and start.record is not None
    assert start.record.state is SessionState.NEW and not start.record.dirty

    await _idle_live(index, "spilled")
    await index.mark_spilled("acme", "spilled", generation=2, blob_key="k2", nbytes=5)
    start = await index.start_turn("acme", "spilled", **START)
    assert not start.busy and start.record == await index.get("acme", "spilled")

    await _idle_live(index, "plain")
    start = await index.start_turn("acme", "plain", mark_busy=False, **START)
    assert start.lock is not None and not start.busy and await index.is_idle("acme", "plain")

    await _idle_live(index, "refused", "beta")  # a tenant with no place taken yet
    limited = {**START, "inflight_limit": 1}
    first = await index.start_turn("beta", "refused", mark_busy=False, **limited)
    assert first.refused == "" and first.lock is not None
    await index.apply(first.record, index.decide_idle("refused"), lock=None, idle=True)  # type: ignore[arg-type]
    await index.release_inflight("beta", first.inflight_token)
    await SessionLocks(redis_client, prefix="sk").release(first.lock)  # type: ignore[arg-type]
    blocker = await index.start_turn("beta", "other", **limited)  # takes the tenant's one place
    assert blocker.refused == ""
    refused = await index.start_turn("beta", "refused", **limited)
    assert refused.refused == "inflight" and not refused.busy and await index.is_idle("beta", "refused")


async def test_the_opening_read_says_the_tenants_counts_and_when_the_lock_was_asked_for(
    index: SessionIndex, redis_client: Any
) -> None:
    await _idle_live(index)
    before = time.monotonic()
    first = await index.start_turn("acme", "s", rpm_limit=100, **START)
    assert (first.rate, first.inflight) == (1, 1)  # this request counted in both
    assert first.lock is not None and before <= first.lock.since <= time.monotonic()
    other = await index.start_turn("acme", "other", rpm_limit=100, **START)
    assert (other.rate, other.inflight) == (2, 2)
    unlimited = await index.start_turn("acme", "third", **START)
    assert (unlimited.rate, unlimited.inflight) == (-1, 3)  # no rate limit: not counted
    # A renewal says when it was asked for too: the lock holds at least until since + TTL.
    locks = SessionLocks(redis_client, prefix="sk")
    renewed = await locks.extend(first.lock)
    assert renewed.since >= first.lock.since and renewed.ttl_s == first.lock.ttl_s
    acquired = await locks.try_acquire("acme", "fresh", ttl_s=30)
    assert acquired is not None and acquired.since > 0

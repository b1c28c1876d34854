"""gateway.turn.early: when a warm turn may go to its slot before its opening read (pure decisions over a
hold, the cached engine and what earlier reads said of the tenant), and the call started so —
awaited once confirmed, made again when the engine refuses it as meant for an earlier process,
abandoned (cancelled, or closed when it already answered) otherwise."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import time

import pytest

from engine_pool.errors import Conflict, InstanceChanged, Unavailable
from gateway.cluster import EngineRef
from gateway.turn.early import EarlyCall, EarlyStart, early_start, fenced
from gateway.turn.hold import Phase, SessionHold
from gateway.turn.opening import Admission
from storage.index.locks import SessionLock
from storage.index.records import SessionRecord, SessionState
from storage.index.turnops import TurnStart

TTL = 15.0
ENGINE = EngineRef("n1/e0", "n1", "http://10.0.0.5:9001", "qwen", 4, "inst-1")
LIVE = SessionRecord("acme", "s1", SessionState.LIVE, model="qwen", tokens=900, engine="n1/e0", slot=2)


def _hold(record: SessionRecord | None = LIVE, *, since: float | None = None) -> SessionHold:
    """A hold just taken over for a new turn (RUNNING, the previous turn's bookkeeping written)."""
    lock = SessionLock("acme", "s1", "tok", TTL, time.monotonic() if since is None else since)
    hold = SessionHold(lock, record)
    hold.phase = Phase.RUNNING
    return hold


def _decide(hold: SessionHold, engine: EngineRef | None = ENGINE, model: str = "qwen") -> EarlyStart | None:
    return early_start(hold, engine, model, time.monotonic(), margin_s=TTL / 3)


async def test_a_held_live_session_goes_to_its_slot_on_its_engine_process() -> None:
    assert _decide(_hold()) == EarlyStart("n1/e0", 2, "http://10.0.0.5:9001", "inst-1")
    assert _decide(_hold()).headers() == {"x-slotkeeper-instance": "inst-1"}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "record",
    [
        None,  # not known here: the read must say
        dataclasses.replace(LIVE, state=SessionState.SPILLED, engine=None, slot=None),
        dataclasses.replace(LIVE, state=SessionState.NEW),
        dataclasses.replace(LIVE, engine=None),
        dataclasses.replace(LIVE, slot=None),
        dataclasses.replace(LIVE, slot=4),  # beyond the engine's slots
        dataclasses.replace(LIVE, slot=-1),
        dataclasses.replace(LIVE, model="other"),  # the request asks for another model
        dataclasses.replace(LIVE, engine="n1/e1"),  # the record names another engine than the cache's
    ],
)
async def test_no_early_start_unless_the_record_says_live_in_a_slot_of_that_engine(
    record: SessionRecord | None,
) -> None:
    assert _decide(_hold(record)) is None


@pytest.mark.parametrize(
    "engine",
    [
        None,  # not in the cached registry (or the cache is stale)
        dataclasses.replace(ENGINE, instance=""),  # registered by a node that names no instance
        dataclasses.replace(ENGINE, url=""),
        dataclasses.replace(ENGINE, model="other"),
    ],
)
async def test_no_early_start_to_an_engine_the_cache_cannot_vouch_for(engine: EngineRef | None) -> None:
    assert _decide(_hold(), engine) is None


async def test_no_early_start_unless_the_lock_is_certainly_held_well_beyond_the_read() -> None:
    now = time.monotonic()
    assert _decide(_hold(since=now - TTL * 2 / 3 + 0.5)) is not None  # 5.5 s left of 15: enough
    assert _decide(_hold(since=now - TTL * 2 / 3 - 0.5)) is None  # 4.5 s left: a renewal is late
    assert _decide(_hold(since=now - TTL - 1)) is None  # lapsed
    unknown = _hold()
    unknown.valid_until = 0.0  # a lock whose acquire time is not known (or one being released)
    assert _decide(unknown) is None


async def test_no_early_start_on_a_hold_another_turn_runs_on_or_that_is_settling() -> None:
    hold = _hold()
    assert _decide(hold) is not None
    hold.phase = Phase.SETTLING  # not taken over for this turn
    assert _decide(hold) is None
    hold.phase = Phase.ANSWERED
    assert _decide(hold) is None
    hold.phase = Phase.RUNNING
    hold.booked.clear()  # the previous turn's bookkeeping is not written yet
    assert _decide(hold) is None
    hold.booked.set()
    hold.released.set_result(None)  # released meanwhile
    assert _decide(hold) is None


def test_admission_room_follows_the_reads_rate_and_in_flight_counts() -> None:
    now = 1_000_000 * 60 + 10.0  # 10 s into a minute
    a = Admission()
    assert a.room(None, 64, now)  # nothing known: the first read refuses what must be refused
    a.seen(TurnStart(rate=50, inflight=3), now)
    assert a.room(100, 64, now) and a.room(None, 64, now)
    assert not a.room(55, 64, now)  # 51 of 55 is past 90 %: near the limit, wait for the read
    assert a.room(55, 64, now + 60)  # a new window counts from nothing
    assert not a.room(100, 3, now)  # the last read used the last in-flight place
    a.seen(TurnStart(rate=-1, inflight=1), now)  # a read without a rate limit keeps the count
    assert a.rate == 50 and a.room(100, 3, now)


def test_a_refusal_stops_early_starts_until_its_window_or_backoff_ends() -> None:
    now = 1_000_000 * 60 + 10.0
    a = Admission()
    a.seen(TurnStart(refused="rate", count=101), now)
    assert not a.room(100, 64, now) and not a.room(None, 64, now + 49)
    assert a.room(100, 64, now + 50)  # the next minute
    b = Admission()
    b.seen(TurnStart(refused="inflight", count=9), now)
    assert not b.room(None, 8, now + 0.5)
    assert b.room(None, 8, now + 1.5)


def test_only_the_engines_instance_refusal_counts_as_fenced() -> None:
    assert fenced(InstanceChanged("restarted"))
    assert fenced(Conflict("x", code="engine_instance_changed"))  # as relayed from the engine's answer
    assert not fenced(Conflict("another conflict"))
    assert not fenced(Unavailable("down"))
    assert not fenced(RuntimeError("engine_instance_changed"))


async def test_a_confirmed_call_is_its_answer() -> None:
    async def answer() -> str:
        return "tokens"

    async def again() -> str:
        raise AssertionError("not made again")

    assert await EarlyCall(answer()).result(again) == ("tokens", False)


async def test_a_call_the_engine_refused_as_meant_for_an_earlier_process_is_made_again() -> None:
    async def refused() -> str:
        raise Conflict("another process", code="engine_instance_changed")

    async def again() -> str:
        return "answered by the ordinary call"

    assert await EarlyCall(refused()).result(again) == ("answered by the ordinary call", True)

    async def down() -> str:
        raise Unavailable("the engine is unreachable")

    with pytest.raises(Unavailable):
        await EarlyCall(down()).result(again)


async def test_a_discarded_call_in_flight_is_cancelled() -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def slow() -> str:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "late"

    call = EarlyCall(slow())
    await started.wait()
    call.discard()
    await asyncio.wait_for(cancelled.wait(), 5)


async def test_a_discarded_call_that_already_answered_is_closed_once() -> None:
    closed: list[str] = []

    async def opened() -> str:
        return "stream"

    call = EarlyCall(opened(), closed.append)
    await asyncio.sleep(0)  # it answered before the turn decided
    await asyncio.sleep(0)
    call.discard()
    call.discard()
    assert closed == ["stream"]
    closed.clear()
    late = EarlyCall(opened(), closed.append)
    late.discard()  # discarded before it ran: cancelled, nothing to close
    await asyncio.sleep(0)
    assert closed == []


async def test_a_discarded_call_that_failed_leaves_no_unretrieved_exception() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:

        async def broken() -> str:
            raise Unavailable("down")

        for when in ("after it failed", "before it ran"):
            call = EarlyCall(broken())
            if when == "after it failed":
                await asyncio.sleep(0)
            call.discard()
            await asyncio.sleep(0)
            del call
            gc.collect()  # a task whose exception nobody retrieved reports it when collected
        assert reported == []
    finally:
        loop.set_exception_handler(None)

"""engine_pool/server/slot_leases.py: slot choice (pure) and leases with a bounded queue (event loop)."""

from __future__ import annotations

import asyncio

import pytest

from engine_pool.errors import SlotBusy, Unavailable
from engine_pool.server.slot_leases import SlotLeases, SlotView, choose_slot, common_prefix


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2, 3]) == 2


def test_longest_common_prefix_wins_among_free_slots() -> None:
    prompt = list(range(20))
    slots = [
        SlotView(0, True, [0, 1, 2], 5.0),
        SlotView(1, True, list(range(15)) + [99], 9.0),
        SlotView(2, False, list(range(20)), 1.0),  # busy: never chosen
    ]
    assert choose_slot(slots, prompt) == 1


def test_least_recently_used_without_a_useful_prefix() -> None:
    prompt = list(range(100))
    slots = [SlotView(0, True, [0, 1, 2, 3], 5.0), SlotView(1, True, [], 2.0), SlotView(2, True, [7], 3.0)]
    # A 4-token prefix of a 100-token prompt is below the 10 % bar: LRU decides.
    assert choose_slot(slots, prompt) == 1
    assert choose_slot([SlotView(0, False, [], 0.0)], prompt) is None


def test_a_prompt_that_only_shares_a_prefix_goes_to_an_empty_slot() -> None:
    system = list(range(50))
    held = SlotView(0, True, [*system, *range(100, 140)], 5.0, prompt_n=80)  # its conversation
    empty = SlotView(1, True, [], 9.0)
    new = [*system, *range(200, 230)]  # another conversation with the same system prompt
    assert choose_slot([held, empty], new, 3) == 1  # from slot 0's state; slot 0 keeps its own
    assert choose_slot([held], new, 3) == 0  # no empty slot: as llama-server, the best prefix
    nxt = [*system, *range(100, 138), 7]  # its next turn: leaves the slot within its last reply
    assert choose_slot([held, empty], nxt, 3) == 0
    retold = [*system, *range(100, 128), 7]  # leaves it 2 tokens before its last prompt ended
    assert choose_slot([held, empty], retold, 3) == 0
    assert choose_slot([held, empty], retold, 0) == 1
    unknown = SlotView(0, True, held.tokens, 5.0)  # restored: its last prompt is not known
    assert choose_slot([unknown, empty], new, 3) == 0


async def _tokens(slot: int) -> list[int]:
    return [slot]


async def _leased_with_a_waiter() -> tuple[SlotLeases, asyncio.Task[int]]:
    """One slot, leased, and a second request for it waiting in the queue."""
    s = SlotLeases(1, queue_size=4, retry_after_s=1, fetch_tokens=_tokens)
    await s.acquire(0)
    waiter = asyncio.create_task(s.acquire(0))
    await asyncio.sleep(0)
    return s, waiter


async def test_leases_queue_and_bound() -> None:
    s = SlotLeases(2, queue_size=1, retry_after_s=2, fetch_tokens=_tokens)
    assert {await s.acquire(), await s.acquire()} == {0, 1}
    waiter = asyncio.create_task(s.acquire(0))
    await asyncio.sleep(0)
    assert s.n_waiting() == 1 and s.waiting_for(0) == 1
    with pytest.raises(Unavailable) as exc:
        await s.acquire()
    assert exc.value.retry_after == 2 and "queue is full" in exc.value.message
    s.release(0)
    assert await waiter == 0
    assert s.n_busy() == 2


async def test_slot_operation_waits_then_times_out_without_counting_against_the_queue() -> None:
    s = SlotLeases(1, queue_size=0, retry_after_s=1, fetch_tokens=_tokens)
    await s.acquire(0)
    with pytest.raises(SlotBusy, match="still busy after 0.05 s"):
        await s.acquire(0, purpose="save", wait_s=0.05)
    assert s.n_waiting() == 0
    op = asyncio.create_task(s.acquire(0, purpose="erase", wait_s=5))
    await asyncio.sleep(0)
    s.release(0)
    assert await op == 0 and s.purpose(0) == "erase"


async def test_a_cancelled_waiter_leaves_the_queue() -> None:
    s, w = await _leased_with_a_waiter()
    w.cancel()
    with pytest.raises(asyncio.CancelledError):
        await w
    assert s.n_waiting() == 0
    s.release(0)
    assert await s.acquire(0) == 0


async def test_released_slot_is_chosen_by_its_refreshed_tokens() -> None:
    contents = {0: [1, 2, 3, 4, 5], 1: [9, 9]}

    async def fetch(slot: int) -> list[int]:
        return contents[slot]

    s = SlotLeases(2, queue_size=4, retry_after_s=1, fetch_tokens=fetch)
    a, b = await s.acquire(0), await s.acquire(1)
    s.release(b)
    s.release(a)
    assert await s.acquire(-1, [1, 2, 3, 4, 5, 6]) == 0
    assert s.n_tokens(0) == 5


async def test_close_fails_waiters() -> None:
    s, w = await _leased_with_a_waiter()
    s.close()
    with pytest.raises(Unavailable, match="shutting down"):
        await w
    with pytest.raises(Unavailable):
        await s.acquire(0)

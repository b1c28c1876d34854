"""Slots this gateway process has chosen but the index does not show taken yet.

Between choosing a slot (`choose_placement` over a pool view) and recording the session there
(`mark_live`), a placement evicts into, fills or erases the slot: meanwhile another request of
this process must not choose it too, or both would fill one slot and one session would run on the
other's state. And a reservation may only be forgotten once no placement can still be deciding
from a pool view read before that record was written, so every pool view is numbered when it starts
and a reservation keeps counting as taken for every pool view that started before its release.
Two placements may hold one slot at once — a turn on its live slot holds it without a pool view (its
session's lock makes the slot its own), while another placement may have chosen that slot to evict
the session — so holds are counted: the slot stays taken until the last holder releases it.

One owner (the process's `TurnParts`, gateway.turn.parts), event-loop only, no awaits inside:
what a choice sees and the reservation it makes happen in one step. Between gateway processes
the index is the only arbiter (a race there costs a re-prefill, never a wrong answer: the engine
compares tokens).
"""

from __future__ import annotations

import itertools
from collections import Counter

Slot = tuple[str, int]  # (engine id, slot number)


class SlotReservations:
    def __init__(self) -> None:
        self._clock = itertools.count(1)
        self._holders: Counter[Slot] = Counter()  # slot -> how many placements hold it now
        self._released: dict[Slot, int] = {}  # slot -> when it was last released
        self._reading: Counter[int] = Counter()  # start numbers of the pool views being read

    def start_pool_view(self) -> int:
        """Number a pool view about to be read; pass it to `taken` and then `end_pool_view`."""
        started = next(self._clock)
        self._reading[started] += 1
        return started

    def end_pool_view(self, started: int) -> None:
        self._reading[started] -= 1
        if not self._reading[started]:
            del self._reading[started]
        self._forget_released()

    def taken(self, started: int) -> set[Slot]:
        """The slots a pool view started at `started` must treat as busy: those held now, and those
        released after it started (its reading may predate their record)."""
        return set(self._holders) | {slot for slot, released in self._released.items() if released > started}

    def hold(self, slot: Slot) -> None:
        self._holders[slot] += 1

    def release(self, slot: Slot) -> None:
        """One holder's session is recorded in the slot now (or its placement failed)."""
        if slot not in self._holders:
            return
        self._holders[slot] -= 1
        if not self._holders[slot]:
            del self._holders[slot]
        self._released[slot] = next(self._clock)
        self._forget_released()

    def _forget_released(self) -> None:
        oldest = min(self._reading, default=None)
        for slot, released in list(self._released.items()):
            if oldest is None or released < oldest:
                del self._released[slot]

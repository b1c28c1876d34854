"""Restores admitted by the bytes they hold in flight on a node.

A restore holds its generation's bytes on the way into a slot: the slot file it writes (the page
cache's until it is written back) and the engine's map of it while it loads it; a restore from the
store also holds the pieces it is writing (:mod:`storage.chunks.chunkstore`: a few windows of
them). A handoff's install into its decode slot holds its file the same way. A node asked for many
long sessions at once (a gateway restart, a node taking over another's sessions) would hold all of
them at once. The gate lets restores start while the bytes in flight stay within the node's
budget; the others wait in arrival order (a small restore never overtakes a large one that waits:
it would starve). A restore larger than the whole budget starts when nothing else is in flight,
alone.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass


def admits(in_flight: int, n: int, budget: int) -> bool:
    """Whether a restore of ``n`` bytes may start while ``in_flight`` bytes are held (``budget``
    0: no bound)."""
    return budget <= 0 or in_flight == 0 or in_flight + n <= budget


@dataclass
class _Waiter:
    n: int
    granted: asyncio.Future[None]


class RestoreGate:
    """The owner of a node's restore bytes in flight (see the module doc)."""

    def __init__(self, budget: int) -> None:
        if budget < 0:
            raise ValueError(f"a restore budget of {budget} bytes")
        self.budget = budget
        self.in_flight = 0
        self._queue: deque[_Waiter] = deque()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @asynccontextmanager
    async def admit(self, n: int) -> AsyncIterator[float]:
        """Hold ``n`` bytes for the body's time; yields the seconds waited for them (0.0: none)."""
        n, waited = max(0, n), 0.0
        if not self._queue and admits(self.in_flight, n, self.budget):
            self.in_flight += n
        else:
            t0 = time.monotonic()
            await self._wait(n)
            waited = max(time.monotonic() - t0, 1e-9)
        try:
            yield waited
        finally:
            self.in_flight -= n
            self._grant()

    async def _wait(self, n: int) -> None:
        waiter = _Waiter(n, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
        try:
            await waiter.granted
        except BaseException:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self.in_flight -= n  # granted as it was cancelled: the bytes go back
            else:
                self._queue.remove(waiter)
            self._grant()  # it may have held up the ones behind it
            raise

    def _grant(self) -> None:
        while self._queue and admits(self.in_flight, self._queue[0].n, self.budget):
            waiter = self._queue.popleft()
            self.in_flight += waiter.n
            waiter.granted.set_result(None)

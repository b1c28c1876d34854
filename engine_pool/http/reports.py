"""What a task reports while it runs, for a response that streams the reports before its outcome
(a node's fill reporting its progress; a gateway's turn reporting its restore's).

The task sends each report with `Reports.send` (synchronously, on the loop). The response waits for
the first report or the task's end (`first`): a task that ends before it reports anything is
answered as it would be without reports (its error an ordinary HTTP error), and only a task that
reported starts a stream — of its reports as they come (`rest`), then its outcome.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Reports(Generic[T]):
    """One task's reports, in the order sent; owned by the response that streams them."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[T] = asyncio.Queue()

    def send(self, report: T) -> None:
        self._queue.put_nowait(report)

    async def first(self, task: asyncio.Future[Any]) -> T | None:
        """The first report, or None when ``task`` ended before it sent one."""
        report = self._next()
        if report is None and not task.done():
            report = await self._next_or_end(task)
        return report if report is not None else self._next()

    async def rest(self, task: asyncio.Future[Any]) -> AsyncIterator[T]:
        """The reports sent until ``task`` ends, those still queued then included."""
        while not task.done():
            report = await self._next_or_end(task)
            if report is not None:
                yield report
        while (report := self._next()) is not None:
            yield report

    async def _next_or_end(self, task: asyncio.Future[Any]) -> T | None:
        """The next report, or None when ``task`` ended first."""
        got = asyncio.ensure_future(self._queue.get())
        try:
            await asyncio.wait((task, got), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not got.done():
                got.cancel()
        return got.result() if got.done() and not got.cancelled() else None

    def _next(self) -> T | None:
        return None if self._queue.empty() else self._queue.get_nowait()


def leave_running(task: asyncio.Future[Any]) -> None:
    """Let ``task`` finish on its own after its stream ended early (the caller left): its outcome
    is nobody's now, and its error is not reported as never retrieved."""
    if not task.done():
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

"""A fill's progress, for a caller that asked for it (`FillRequest.progress`): what stage the fill
is at and how many of the stored generation's bytes have come in, as `FillProgress` reports.

The fill (engine_pool.pool.fill) says when a stage begins; the store says each piece it brings in
(storage.fetch_progress), as often as it fetches one. `due` keeps the reports to a few a second
while the bytes come, and the last one of a stage is always sent.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from storage.fetch_progress import watched

from ..protocol.node import FillProgress

REPORT_EVERY_S = 0.1  # at most this often while a fetch's bytes come in


def due(now: float, last: float | None, got: int, total: int) -> bool:
    """Whether a fetch's report is sent now: the first, one ``REPORT_EVERY_S`` after the last,
    and the one that completes ``total``. Pure."""
    return last is None or now - last >= REPORT_EVERY_S or (total > 0 and got >= total)


class FillWatch:
    """One fill's reports, sent to ``report`` (None: nobody asked; every call does nothing). Owned
    by the fill's task; the store's fetches in a :meth:`fetching` block report to it (on the loop)."""

    def __init__(
        self,
        report: Callable[[FillProgress], None] | None,
        total: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._report = report
        self._clock = clock
        self._t0 = clock()
        self.total = total
        self._got = 0
        self._last: float | None = None

    @contextlib.contextmanager
    def fetching(self) -> Iterator[None]:
        """A block in which the generation is fetched from the store: reported as it begins, then
        as its bytes come in (never past ``total``)."""
        if self._report is None:
            yield
            return
        self._got, self._last = 0, None
        self._send("fetching", 0)
        with watched(self._fetched):
            yield

    def restoring(self) -> None:
        """The engine is loading the file into the slot (what was fetched is all in)."""
        if self._report is not None:
            got = self._got if self._last is not None else self.total  # (a local copy: all here)
            self._send("restoring", self._within_total(got))

    def _fetched(self, n: int) -> None:
        self._got += n
        got = self._within_total(self._got)
        if due(self._clock(), self._last, got, self.total):
            self._send("fetching", got)

    def _within_total(self, n: int) -> int:
        return min(n, self.total) if self.total else n

    def _send(self, stage: str, got: int) -> None:
        assert self._report is not None
        now = self._clock()
        self._last = now
        self._report(FillProgress(stage, got, self.total, round((now - self._t0) * 1000, 2)))

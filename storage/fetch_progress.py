"""How far a fetch from the store has come: the bytes of a generation a store has brought in,
reported to whoever watches the block they are fetched in (a node's fill, which tells the gateway,
which tells a tenant's stream: `return_progress`).

The watcher is the block's, as :meth:`storage.blobs.blobstore.BlobStore.one_read`'s manifests are:
a context variable, so the tasks and threads a fetch starts report to it and nothing outside the
block does. A store that brings a generation in pieces (:class:`storage.chunks.chunkstore.ChunkedStore`)
reports each piece as it arrives; a whole-file store reports nothing on the way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

# What a fetch in a `watched` block reports to: the bytes it has just brought in.
_WATCHER: ContextVar[Callable[[int], None] | None] = ContextVar("slotkeeper_fetch_watcher", default=None)


@contextlib.contextmanager
def watched(report: Callable[[int], None]) -> Iterator[None]:
    """A block whose fetches call ``report(n)`` with each ``n`` bytes they bring in."""
    token = _WATCHER.set(report)
    try:
        yield
    finally:
        _WATCHER.reset(token)


def fetched(n: int) -> None:
    """``n`` more bytes of a generation came in: told to the block's watcher, if any."""
    report = _WATCHER.get()
    if report is not None and n > 0:
        report(n)

"""The event loop our processes run on: uvloop where it is installed (as uvicorn's own `run` picks
with `loop="auto"`), else asyncio's. Entry points that drive uvicorn through `Server.serve()` call
`run` instead of `asyncio.run`, so they get the same loop as the engines (`Server.run`)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on the platforms it supports
        return asyncio.run(main)
    return uvloop.run(main)


async def cancel_and_wait(*tasks: asyncio.Future[Any], every_s: float = 1.0) -> None:
    """Cancel ``tasks`` and wait until every one has ended (what each raised is dropped).

    A cancellation can be lost on Python 3.11: `asyncio.wait_for` returns the inner result when it
    completes at the moment the waiting task is cancelled (CPython gh-86296, fixed in 3.12), and
    redis-py sends every command through `wait_for` while a socket timeout is set (its default, 5
    s). A loop that swallowed its cancellation so goes on waiting and never ends (a gateway's
    retention task kept its shutdown waiting forever). So a task not done ``every_s`` after its
    cancellation is cancelled again."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=every_s)
    for task in tasks:
        if not task.cancelled():
            task.exception()  # (retrieved: a task that failed is not reported again when collected)

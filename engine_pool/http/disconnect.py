"""Work for a request that stops when its caller leaves.

The request's body was read whole before the work started, so the next ASGI message is the
disconnect: `unless_caller_leaves` waits for the first of the two. When the caller leaves first,
the work is cancelled — which closes the connections it opened to other services, and so cancels
what they run for it (an engine stops generating) — and `ClientGone` is raised (499, answered to
nobody).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from engine_pool.errors import ClientGone

T = TypeVar("T")


async def unless_caller_leaves(
    request: Request, work: Awaitable[T], gone_means: str, settle: bool = False
) -> T:
    """`work`'s result, unless the caller disconnects first: then `work` is cancelled and
    `ClientGone(gone_means)` raised. ``settle``: wait for the cancelled work to finish its cleanup
    (files, lent slots) before raising."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone(gone_means)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            if settle:
                with contextlib.suppress(BaseException):
                    await task


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass

"""storage.fetch_progress: what a fetch brings in reaches the watcher of the block it runs in, and
only that one."""

from __future__ import annotations

import asyncio

from storage.fetch_progress import fetched, watched


async def test_a_block_s_fetches_report_to_its_watcher_and_nobody_else_s() -> None:
    outer: list[int] = []
    inner: list[int] = []
    fetched(5)  # nobody watches: nothing happens
    with watched(outer.append):
        fetched(3)
        fetched(0)  # (nothing came)
        with watched(inner.append):
            await asyncio.to_thread(fetched, 7)  # a thread the block started reports to it
            await asyncio.gather(asyncio.create_task(asyncio.sleep(0, fetched(2))))
        fetched(4)
    fetched(6)
    assert outer == [3, 4] and inner == [7, 2]


async def test_concurrent_blocks_each_hear_their_own() -> None:
    seen: dict[str, list[int]] = {"a": [], "b": []}
    started = asyncio.Barrier(2)

    async def fill(name: str, n: int) -> None:
        with watched(seen[name].append):
            await started.wait()  # both blocks open at once
            for _ in range(3):
                fetched(n)
                await asyncio.sleep(0)

    await asyncio.gather(fill("a", 1), fill("b", 2))
    assert seen == {"a": [1, 1, 1], "b": [2, 2, 2]}

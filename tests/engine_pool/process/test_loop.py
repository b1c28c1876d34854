"""engine_pool.process.loop.cancel_and_wait: our own tasks end when cancelled, even one that lost its
cancellation (Python 3.11's `asyncio.wait_for`, which redis-py sends every command through, drops
a cancellation that lands as its inner future completes: CPython gh-86296)."""

from __future__ import annotations

import asyncio

from engine_pool.process.loop import cancel_and_wait


async def test_a_task_that_lost_its_cancellation_is_cancelled_again_until_it_ends() -> None:
    lost = asyncio.Event()

    async def loop_that_swallows_once() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:  # what a lost cancellation looks like from outside
            lost.set()
        await asyncio.Event().wait()  # and the loop goes on waiting, for nothing that comes

    task = asyncio.create_task(loop_that_swallows_once())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task, every_s=0.05), 5)
    assert lost.is_set() and task.cancelled()


async def test_tasks_that_end_or_failed_are_waited_for_and_their_errors_dropped() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    async def cleans_up(done: list[str]) -> None:
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0.01)  # a short cleanup is not interrupted
            done.append("cleaned")

    done: list[str] = []
    failed, slow = asyncio.create_task(fails()), asyncio.create_task(cleans_up(done))
    await asyncio.sleep(0)
    await cancel_and_wait(failed, slow, every_s=1.0)
    assert failed.done() and slow.cancelled() and done == ["cleaned"]
    await cancel_and_wait()  # nothing to wait for

"""engine_pool.http.reports: a task's reports, streamed before its outcome — the first report or the
task's end, then every report in order until the task ends (those queued by then included)."""

from __future__ import annotations

import asyncio

import pytest

from engine_pool.http.reports import Reports, leave_running


async def test_a_task_that_ends_before_reporting_has_no_first_report() -> None:
    reports: Reports[int] = Reports()
    task = asyncio.ensure_future(asyncio.sleep(0, "done"))
    assert await reports.first(task) is None and task.result() == "done"


async def test_the_reports_come_in_order_until_the_task_ends() -> None:
    reports: Reports[int] = Reports()
    go = asyncio.Event()

    async def work() -> str:
        reports.send(1)
        await go.wait()
        for n in (2, 3):
            reports.send(n)
            await asyncio.sleep(0)
        reports.send(4)  # sent as it ends: still streamed
        return "answer"

    task = asyncio.ensure_future(work())
    assert await reports.first(task) == 1
    go.set()
    assert [n async for n in reports.rest(task)] == [2, 3, 4]
    assert task.result() == "answer"


async def test_a_report_sent_by_a_task_that_failed_is_streamed_before_its_error() -> None:
    reports: Reports[str] = Reports()

    async def work() -> None:
        reports.send("fetching")
        await asyncio.sleep(0)
        reports.send("restoring")
        raise ValueError("damaged")

    task = asyncio.ensure_future(work())
    assert await reports.first(task) == "fetching"
    assert [r async for r in reports.rest(task)] == ["restoring"]
    with pytest.raises(ValueError, match="damaged"):
        task.result()


async def test_a_task_left_running_ends_on_its_own_and_its_error_is_retrieved() -> None:
    go = asyncio.Event()

    async def work() -> None:
        await go.wait()
        raise RuntimeError("nobody listens")

    task = asyncio.ensure_future(work())
    leave_running(task)
    go.set()
    await asyncio.wait({task})
    assert not task.cancelled() and isinstance(task.exception(), RuntimeError)

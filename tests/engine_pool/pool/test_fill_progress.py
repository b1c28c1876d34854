"""engine_pool.pool.fill_progress: a fill's reports — a fetch from its start, its bytes as they
come (a few a second, never past the state's size, the last always), then the restore."""

from __future__ import annotations

from engine_pool.pool.fill_progress import REPORT_EVERY_S, FillWatch, due
from engine_pool.protocol.node import FillProgress
from storage.fetch_progress import fetched, watched


def test_a_report_is_due_first_then_at_most_every_interval_and_at_the_end() -> None:
    assert due(10.0, None, 0, 100)
    assert not due(10.0 + REPORT_EVERY_S / 2, 10.0, 50, 100)
    assert due(10.0 + REPORT_EVERY_S * 1.5, 10.0, 50, 100)
    assert due(10.0 + REPORT_EVERY_S / 2, 10.0, 100, 100)  # the one that completes it
    assert not due(10.0 + REPORT_EVERY_S / 2, 10.0, 100, 0)  # (a size not known: by time only)


def test_a_fill_nobody_watches_reports_nothing_and_takes_nothing_from_the_block_around_it() -> None:
    around: list[int] = []
    watch = FillWatch(None, 100)
    with watched(around.append), watch.fetching():
        fetched(100)
    watch.restoring()
    assert around == [100]  # (no watcher of its own installed)


def test_a_fetch_is_reported_from_its_start_to_its_whole_size_then_the_restore() -> None:
    reports: list[FillProgress] = []
    now = [5.0]
    watch = FillWatch(reports.append, 1000, clock=lambda: now[0])
    with watch.fetching():
        fetched(100)  # within the interval of the first report: held back
        now[0] += 0.25  # (past the interval)
        fetched(300)  # an interval later: sent
        fetched(200)  # held back
        fetched(700)  # past the size (a plan's pieces may hold more than the file): the last
    fetched(50)  # after the block: not this fill's
    now[0] += 1.0
    watch.restoring()
    assert [(r.stage, r.bytes, r.total) for r in reports] == [
        ("fetching", 0, 1000),
        ("fetching", 400, 1000),
        ("fetching", 1000, 1000),
        ("restoring", 1000, 1000),
    ]
    assert [r.ms for r in reports] == [0.0, 250.0, 250.0, 1250.0]


def test_a_copy_at_hand_is_reported_as_the_restore_of_the_whole_state() -> None:
    reports: list[FillProgress] = []
    FillWatch(reports.append, 640).restoring()
    assert [(r.stage, r.bytes, r.total) for r in reports] == [("restoring", 640, 640)]


def test_a_fetch_begun_again_starts_from_nothing() -> None:
    reports: list[FillProgress] = []
    watch = FillWatch(reports.append, 10)
    with watch.fetching():
        fetched(10)
    with watch.fetching():  # the fetch again, checked (its first copy was damaged)
        pass
    assert [(r.stage, r.bytes) for r in reports] == [("fetching", 0), ("fetching", 10), ("fetching", 0)]

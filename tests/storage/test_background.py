"""storage.background: work nobody waits on runs in threads below normal priority."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from storage.background import NICE, in_background


def _own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(sys.platform != "linux", reason="threads have their own nice value on Linux only")
async def test_background_work_runs_below_the_callers_priority() -> None:
    mine = _own_nice()
    theirs = await in_background(_own_nice)
    assert theirs == min(19, mine + NICE) and _own_nice() == mine  # the caller's thread is untouched


async def test_results_and_errors_come_back() -> None:
    assert await in_background(pow, 2, 10) == 1024
    with pytest.raises(ZeroDivisionError):
        await in_background(divmod, 1, 0)

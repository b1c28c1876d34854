"""Threads for work nobody waits on: a save's CPU runs below the engine's priority.

A write-behind save (the engine writing its state's file, the node splitting, hashing and
compressing it) runs beside the session's next turn. On a small machine the two share the cores,
and llama.cpp's threads, which meet at barriers every layer, slow down far more than the save's
share of the CPU. So that work runs in threads whose nice value is raised (Linux nices threads
one by one): it takes what the engine leaves idle. Restores never run here — a turn waits for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

NICE = 10  # added to the nice value: CFS weight 110 against the engine's 1024
_WORKERS = max(2, (os.cpu_count() or 2) // 2)  # saves of several sessions at once (a drain)
_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None


def _lower_this_thread() -> None:
    with contextlib.suppress(OSError, AttributeError):  # not Linux, or not allowed: normal priority
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + NICE))


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(_WORKERS, "background", initializer=_lower_this_thread)
        return _executor


async def in_background(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a low-priority thread (``asyncio.to_thread`` for work nobody waits on)."""
    return await asyncio.get_running_loop().run_in_executor(_pool(), functools.partial(fn, *args))

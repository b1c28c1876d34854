"""Waiting for a started server to answer 200 on `/ready`, with its log's tail when it does not."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx


def wait_ready_while(
    url: str, alive: Callable[[], bool], said: Callable[[], str], timeout: float = 120
) -> None:
    """Returns once `url`/ready answers 200; fails with `said()` (what the server wrote) as soon as
    `alive()` is false, or after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        assert alive() and time.monotonic() < deadline, said()
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 120) -> None:
    """`wait_ready_while` for the process `proc` writing `log`."""

    def said() -> str:
        state = "still running" if proc.poll() is None else f"exited with {proc.returncode}"
        return f"serve not ready after {timeout}s ({state}):\n{log.read_text(errors='replace')[-3000:]}"

    wait_ready_while(url, lambda: proc.poll() is None, said, timeout)

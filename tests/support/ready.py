"""Waiting for a started server to answer 200 on `/ready`, with its log's tail when it does not."""

from __future__ import annotations

import subprocess
from pathlib import Path

from gateway.bench.harness.servers import http_ok, wait_until


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 120) -> None:
    """Returns once `url`/ready answers 200; fails as soon as `proc` exits, or after `timeout` s."""
    try:
        wait_until(lambda: http_ok(url + "/ready"), proc, "serve", timeout)
    except RuntimeError as exc:
        raise AssertionError(f"{exc}:\n{log.read_text()[-3000:]}") from exc

"""`slotkeeper serve` processes (gateway + node agent + engines) on free loopback ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Serve:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(10)

    def engines(self) -> list[dict]:
        return httpx.get(self.node_url + "/v1/engines", timeout=5).json()["engines"]

    node_url: str = ""


@pytest.fixture
def serve(tiny_model: Callable[..., str], tmp_path: Path) -> Iterator[Callable[..., Serve]]:
    """`serve(data_dir, slots=2, tenants=None)` starts `slotkeeper serve` and waits for /ready."""
    started: list[Serve] = []

    def start(data_dir: Path, slots: int = 2, tenants: Path | None = None, port: int | None = None) -> Serve:
        port = port or _free_port()
        node_port = _free_port()
        log = tmp_path / f"serve-{port}-{len(started)}.log"
        cmd = [
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "--port",
            str(port),
            "--node-port",
            str(node_port),
            "--data-dir",
            str(data_dir),
            "--model",
            tiny_model("qwen35"),
            "--slots",
            str(slots),
            "--ctx",
            "2048",
            "--log-level",
            "warning",
        ]
        if tenants is not None:
            cmd += ["--tenants", str(tenants)]
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        s = Serve(f"http://127.0.0.1:{port}", proc, log, node_url=f"http://127.0.0.1:{node_port}")
        started.append(s)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(s.url + "/ready", timeout=2).status_code == 200:
                    return s
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"serve did not become ready:\n{log.read_text()[-3000:]}")

    yield start
    for s in started:
        s.stop(signal.SIGKILL if s.proc.poll() is None else signal.SIGTERM, timeout=30)

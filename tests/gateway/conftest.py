"""`slotkeeper serve` processes (gateway + node agent + engines) on free loopback ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from gateway.bench.harness.servers import INTERNAL_AUTH


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_CLIENTS: list[openai.OpenAI | anthropic.Anthropic] = []


def openai_client(url: str, key: str = "none", timeout: float = 60) -> openai.OpenAI:
    """An `openai` client of a serve at `url`, closed after the test; no retries."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=timeout)
    _CLIENTS.append(client)
    return client


def anthropic_client(url: str, key: str = "none") -> anthropic.Anthropic:
    """An `anthropic` client of a serve at `url`, closed after the test; no retries."""
    client = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60)
    _CLIENTS.append(client)
    return client


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _CLIENTS:
        _CLIENTS.pop().close()


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
        return httpx.get(self.node_url + "/v1/engines", timeout=5, headers=INTERNAL_AUTH).json()["engines"]

    node_url: str = ""


def start_serve(
    model: str,
    data_dir: Path,
    log: Path,
    *,
    slots: int = 2,
    tenants: Path | None = None,
    port: int | None = None,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Serve:
    """Start `slotkeeper serve` (its own process group) and wait for /ready."""
    port = port or _free_port()
    node_port = _free_port()
    cmd = [
        *(sys.executable, "-m", "gateway.cli", "serve"),
        *("--port", str(port)),
        *("--node-port", str(node_port)),
        *("--data-dir", str(data_dir)),
        *("--model", model),
        *("--slots", str(slots)),
        *("--ctx", "2048"),
        *("--log-level", "warning"),
        *args,
    ]
    if tenants is not None:
        cmd += ["--tenants", str(tenants)]
    with log.open("wb") as out:
        full_env = {**os.environ, **(env or {})}
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=full_env
        )
    s = Serve(f"http://127.0.0.1:{port}", proc, log, node_url=f"http://127.0.0.1:{node_port}")
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
    s.stop(signal.SIGKILL)
    raise RuntimeError(f"serve did not become ready:\n{log.read_text()[-3000:]}")


@pytest.fixture
def serve(tiny_model: Callable[..., str], tmp_path: Path) -> Iterator[Callable[..., Serve]]:
    """`serve(data_dir, slots=2, tenants=None, args=(), env=None)` starts `slotkeeper serve`."""
    started: list[Serve] = []

    def start(
        data_dir: Path,
        slots: int = 2,
        tenants: Path | None = None,
        port: int | None = None,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> Serve:
        log = tmp_path / f"serve-{port}-{len(started)}.log"
        s = start_serve(
            tiny_model("qwen35"), data_dir, log, slots=slots, tenants=tenants, port=port, args=args, env=env
        )
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop(signal.SIGKILL if s.proc.poll() is None else signal.SIGTERM, timeout=30)

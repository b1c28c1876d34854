"""A `slotkeeper serve` process for benchmarks and tests: started on free ports with the bench's
internal key, ready when its gateway answers /ready; its engines, log events, and a stop that drains
(SIGTERM) or kills (serve and every engine's process group)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx

from engine_pool.protocol.codec import decode
from engine_pool.protocol.node import NodeEngine
from gateway.bench.harness.answers import engine_list
from gateway.bench.harness.servers import (
    PACKAGE_ROOT,
    free_port,
    kill_engines,
    wait_until,
)

T = TypeVar("T")
INTERNAL_KEY = "bench-internal-key-0123456789"  # serve's credential for its node and engines
INTERNAL_AUTH = {"Authorization": f"Bearer {INTERNAL_KEY}"}


@dataclass
class Serve:
    url: str
    node_url: str
    proc: subprocess.Popen[bytes]
    log: Path
    engine_pids: set[int] = field(default_factory=set)

    def engines(self) -> list[NodeEngine]:
        return engine_list(httpx.get(self.node_url + "/v1/engines", headers=INTERNAL_AUTH, timeout=5))

    def events(self, name: str, payload: type[T]) -> list[T]:
        """The serve log's JSON events called `name` (see `log_events`)."""
        return log_events(self.log, name, payload)

    def terminate(self, timeout: float) -> int:
        """SIGTERM (the node drains: every live session is saved and uploaded), then wait."""
        self._note_engines()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"serve did not drain within {timeout}s:\n{self.tail()}") from None

    def close(self, timeout: float = 120) -> None:
        """Stop gracefully (the node stops its engines); SIGKILL whatever is left."""
        try:
            self.terminate(timeout)
        except RuntimeError:
            pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL serve and its engines: each engine leads its own process group (the supervisor
        starts it in a new session), so killing serve's group alone would orphan them."""
        self._note_engines()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        kill_engines(self.engine_pids)

    def _note_engines(self) -> None:
        if self.proc.poll() is not None:
            return
        try:
            self.engine_pids |= {e.pid for e in self.engines() if e.pid}
        except (httpx.HTTPError, ValueError, KeyError):
            pass

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def log_events(log: Path, name: str, payload: type[T]) -> list[T]:
    """A JSON log's events called `name`, each read as `payload` (a dataclass of the fields the
    event carries; other lines are skipped)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if f'"{name}"' in line:
            try:
                out.append(decode(payload, json.loads(line)))
            except ValueError:  # (a WireError is one)
                continue
    return out


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def start_serve(workdir: Path, name: str, flags: list[str], env: dict[str, str] | None = None) -> Serve:
    port, node_port = free_port(), free_port()
    cmd = [
        *(sys.executable, "-m", "gateway.cli", "serve"),
        *("--port", str(port)),
        *("--node-port", str(node_port)),
        *flags,
    ]
    log = workdir / f"{name}.log"
    env = {**(os.environ if env is None else env), "SLOTKEEPER_INTERNAL_KEY": INTERNAL_KEY}
    with log.open("ab") as out:
        proc = subprocess.Popen(
            cmd, cwd=PACKAGE_ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    serve = Serve(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{node_port}", proc, log)
    try:
        wait_until(lambda: _ready(serve.url), proc, f"slotkeeper serve ({name})", timeout=180)
    except RuntimeError as exc:
        serve.kill()
        raise RuntimeError(f"{exc}\n{serve.tail()}") from None
    return serve


@contextmanager
def serving(workdir: Path, name: str, flags: list[str], env: dict[str, str] | None = None) -> Iterator[Serve]:
    serve = start_serve(workdir, name, flags, env)
    try:
        yield serve
    finally:
        serve.close()

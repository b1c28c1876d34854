"""Fixtures: tiny generated models and real engine processes on loopback ports.

Engines run as `python -m gateway.cli engine ...` subprocesses (exactly what `slotkeeper engine`
runs), one CPU thread each, and are waited for on /health. Session-scoped engines are shared by the
test modules; a test that needs a process of its own starts one with `EngineProcess`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
ENGINE_COMMAND = (sys.executable, "-m", "gateway.cli", "engine")  # what `slotkeeper engine` runs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EngineProcess:
    """One `slotkeeper engine` subprocess."""

    def __init__(self, model: Path, *args: str, log_path: Path, env: dict[str, str] | None = None) -> None:
        self.model = model
        self.args = list(args)
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> EngineProcess:
        self.port = free_port()
        cmd = [*ENGINE_COMMAND, "-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["-t", "1", *self.args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"engine not healthy after {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @contextlib.contextmanager
    def running(self, timeout_s: float = 60.0) -> Iterator[EngineProcess]:
        """Started (healthy within ``timeout_s``), and stopped when the block ends, its exit code 0
        asserted with the log's tail in the message."""
        self.start(timeout_s)
        try:
            yield self
        finally:
            code = self.stop()
            assert code == 0, f"engine exited with {code}:\n{self.log()[-4000:]}"

    def stop(self, grace_s: float = 15.0) -> int:
        """SIGTERM (graceful), then SIGKILL of the process group after `grace_s`."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: a crash, nothing saved on the way out."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="session")
def models(tiny_model: Callable[..., str]) -> dict[str, Path]:
    return {arch: Path(tiny_model(arch)) for arch in ("llama", "qwen35")}


def run_engine(
    tmp_path_factory: pytest.TempPathFactory,
    model: Path,
    *args: str,
    env: dict[str, str] | None = None,
    timeout_s: float = 60.0,
) -> Iterator[EngineProcess]:
    """For a fixture to `yield from`: an engine on `model` with `args`, its log in a fresh temporary
    directory, stopped (its exit code 0 asserted) when the fixture ends."""
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    with EngineProcess(model, *args, log_path=log, env=env).running(timeout_s) as eng:
        yield eng


# Small checkpoint steps so that tiny prompts get interval checkpoints inside them.
CHECKPOINT_ARGS = ("--checkpoint-interval", "32", "--checkpoint-min-step", "8")


@pytest.fixture(scope="session")
def slot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slots")


def _shared_engine(
    tmp_path_factory: pytest.TempPathFactory, models: dict[str, Path], slot_dir: Path, arch: str, *args: str
) -> Iterator[EngineProcess]:
    """The session's engine on `arch`: two slots, 2048 tokens, its own slot directory."""
    slots = ("-np", "2", "-c", "2048", "--slot-save-path", str(slot_dir / arch))
    yield from run_engine(tmp_path_factory, models[arch], *slots, *args, *CHECKPOINT_ARGS)


@pytest.fixture(scope="session")
def llama_engine(
    models: dict[str, Path], slot_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    yield from _shared_engine(tmp_path_factory, models, slot_dir, "llama")


@pytest.fixture(scope="session")
def qwen_engine(
    models: dict[str, Path], slot_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    yield from _shared_engine(tmp_path_factory, models, slot_dir, "qwen35", "-a", "tiny-qwen")


@pytest.fixture
def llama(llama_engine: EngineProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=llama_engine.url, timeout=60.0) as client:
        yield client


@pytest.fixture
def qwen(qwen_engine: EngineProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=qwen_engine.url, timeout=60.0) as client:
        yield client

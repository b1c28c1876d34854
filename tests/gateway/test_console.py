"""What a person sees running `slotkeeper serve` at a terminal: console lines, not JSON; one access
line per request with its tenant, session, cache source and tokens; no health polls; each start-up
line once; the in-process index named as such; the engine's load time, template and chat format
when it is ready. A pseudo-terminal stands in for the person's terminal, and then a real tmux pane,
where Ctrl-C stops it."""

from __future__ import annotations

import os
import pty
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from support.ready import wait_ready_while

from gateway.bench.harness.servers import free_port

from .conftest import serve_argv

pytestmark = pytest.mark.slow


def test_serve_on_a_terminal_logs_for_a_person(tiny_model: Callable[..., str], tmp_path: Path) -> None:
    port, node_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    main, terminal = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLOTKEEPER_")}
    argv = serve_argv(tiny_model("qwen35"), tmp_path / "data", port, node_port)
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal, start_new_session=True, env=env
    )
    os.close(terminal)
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(main, 65536)
            except OSError:  # the other end closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        chat_once_when_ready(
            url, lambda: proc.poll() is None, lambda: b"".join(chunks).decode(errors="replace")
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        reader.join(10)
        os.close(main)
    assert_lines_for_a_person(b"".join(chunks).decode("utf-8", errors="replace"))


def chat_once_when_ready(url: str, alive: Callable[[], bool], said: Callable[[], str]) -> None:
    """Waits for /ready while the process lives, then one chat in session `console` and three health polls."""
    wait_ready_while(url, alive, said, timeout=90)
    hi = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    r = httpx.post(url + "/v1/chat/completions", timeout=60, headers={"X-Session-Id": "console"}, json=hi)
    assert r.status_code == 200, r.text
    for _ in range(3):
        httpx.get(url + "/health", timeout=5)


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def assert_lines_for_a_person(text: str) -> None:
    text = ANSI.sub("", text)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    assert lines and not any(line.startswith("{") for line in lines), text[:3000]
    access = [line for line in lines if "http.access" in line]
    chat = [line for line in access if "path=/v1/chat/completions" in line]
    assert len(chat) == 1, access
    for part in ("status=200", "tenant=default", "session=console", "cache=cold", "tokens=", "ms="):
        assert part in chat[0], chat[0]
    assert not [line for line in access if "/health" in line or "/ready" in line], access
    assert not [line for line in lines if "HTTP Request:" in line], text[:3000]  # httpx's per-call lines
    assert sum("Started server process" in line for line in lines) == 1, text[:3000]
    assert sum("storage.probed" in line for line in lines) == 2, text[:3000]  # the index and the store
    assert "in-process index" in text and "redis at" not in text
    ready = [line for line in lines if "engine.transition" in line and "to=ready" in line]
    assert len(ready) == 1 and "load_s=" in ready[0] and "chat_template=gguf" in ready[0], ready
    assert "chat_format=" in ready[0], ready
    # One event per line, short: a command line or a save's inner steps are for --log-level debug.
    assert not [line for line in lines if "argv=" in line], text[:3000]
    internals = ("spill.", "storage.chunked_put", "node.spilled", "session.durable", "session.placed")
    assert not [line for line in lines if any(f" {name}" in line for name in internals)], text[:3000]


def test_serve_in_tmux_logs_for_a_person_and_stops_on_ctrl_c(
    tiny_model: Callable[..., str], tmp_path: Path
) -> None:
    """The same in a real terminal multiplexer, stopped as a person stops it: Ctrl-C at the pane."""
    port, node_port = free_port(), free_port()
    url, log, socket = f"http://127.0.0.1:{port}", tmp_path / "pane.log", tmp_path / "tmux.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLOTKEEPER_")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    argv = serve_argv(tiny_model("qwen35"), tmp_path / "data", port, node_port)
    tmux = ["tmux", "-S", str(socket), "-f", "/dev/null"]

    def pane_alive() -> bool:
        asked = subprocess.run(tmux + ["has-session", "-t", "sk"], capture_output=True, env=env)
        return asked.returncode == 0

    # The pane waits for a key before it runs serve, so that its output is piped from the first line.
    script = f"read go; exec {shlex.join(argv)}"
    pane = ["new-session", "-d", "-s", "sk", "-x", "220", "-y", "50", script]
    subprocess.run(tmux + pane, check=True, env=env)
    try:
        subprocess.run(tmux + ["pipe-pane", "-t", "sk", "-o", f"cat >> {shlex.quote(str(log))}"], check=True)
        subprocess.run(tmux + ["send-keys", "-t", "sk", "Enter"], check=True)
        chat_once_when_ready(url, pane_alive, lambda: log.read_text(errors="replace") if log.exists() else "")
        subprocess.run(tmux + ["send-keys", "-t", "sk", "C-c"], check=True)
        deadline = time.monotonic() + 60
        while pane_alive():  # serve exits on Ctrl-C, and its pane with it
            assert time.monotonic() < deadline, "serve still running 60 s after Ctrl-C"
            time.sleep(0.2)
    finally:
        subprocess.run(tmux + ["kill-server"], capture_output=True)
    assert_lines_for_a_person(log.read_text(errors="replace"))

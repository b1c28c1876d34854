"""What a person sees running `slotkeeper serve` at a terminal: console lines, not JSON; one access
line per request with its tenant, session, cache source and tokens; no health polls; each start-up
line once; the in-process index named as such; the engine's load time, template and chat format
when it is ready. A pseudo-terminal stands in for the person's terminal."""

from __future__ import annotations

import os
import pty
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from support.servers import free_port

pytestmark = pytest.mark.slow


def test_serve_on_a_terminal_logs_for_a_person(tiny_model: Callable[..., str], tmp_path: Path) -> None:
    port, node_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    main, terminal = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLOTKEEPER_")}
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--model", tiny_model("qwen35")]
    argv += ["--port", str(port), "--node-port", str(node_port), "--data-dir", str(tmp_path / "data")]
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
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, b"".join(chunks).decode(
                errors="replace"
            )
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        hi = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        r = httpx.post(url + "/v1/chat/completions", timeout=60, headers={"X-Session-Id": "console"}, json=hi)
        assert r.status_code == 200, r.text
        for _ in range(3):
            httpx.get(url + "/health", timeout=5)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        reader.join(10)
        os.close(main)
    text = b"".join(chunks).decode("utf-8", errors="replace")
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

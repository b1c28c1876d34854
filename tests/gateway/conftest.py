"""`slotkeeper serve` processes (gateway + node agent + engines) on free loopback ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from support.ready import wait_ready

from gateway.bench.harness.servers import INTERNAL_AUTH
from gateway.bench.harness.servers import eventually as eventually  # the gateway tests' polling


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


# The coding agent of the gateway tests: its system prompt and its one Anthropic tool.
AGENT_SYSTEM = "You are a coding agent. Read files, run tests, fix bugs, and report briefly. " * 4
READ_FILE = {
    "name": "read_file",
    "description": "Read a file of the repository.",
    "input_schema": {
        "type": "object",
        "properties": {"path": {"type": "string", "maxLength": 16}},
        "required": ["path"],
        "additionalProperties": False,
    },
}


def read_file_turn(
    client: anthropic.Anthropic, messages: list[dict], *, forced: bool, headers: dict[str, str] | None = None
) -> Any:
    """A greedy Messages turn of that agent on `messages`, the raw response: forced to call
    read_file (up to 250 tokens), or free to answer its result (up to 8)."""
    choice = {"tool_choice": {"type": "tool", "name": "read_file"}} if forced else {}
    return client.messages.with_raw_response.create(
        model="claude-test-agent",
        system=AGENT_SYSTEM,
        max_tokens=250 if forced else 8,
        extra_body={"temperature": 0},
        messages=messages,  # type: ignore[arg-type]
        tools=[READ_FILE],  # type: ignore[list-item]
        extra_headers=headers or {},
        **choice,
    )


def add_tool_result(messages: list[dict], response: Any, content: str) -> None:
    """Appends the assistant's `response` to `messages`, then `content` as its first tool_use's result."""
    use = next(b for b in response.content if b.type == "tool_use")
    messages.append({"role": "assistant", "content": [b.model_dump() for b in response.content]})
    messages.append(
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": content}]}
    )


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


def serve_argv(model: str, data_dir: Path, port: int, node_port: int, *args: str) -> list[str]:
    """The command line of `slotkeeper serve` on `model` with `args`."""
    return [
        *(sys.executable, "-m", "gateway.cli", "serve"),
        *("--model", model),
        *("--port", str(port)),
        *("--node-port", str(node_port)),
        *("--data-dir", str(data_dir)),
        *args,
    ]


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
    cmd = serve_argv(model, data_dir, port, node_port, "--slots", str(slots), "--ctx", "2048")
    cmd += ["--log-level", "warning", *args]
    if tenants is not None:
        cmd += ["--tenants", str(tenants)]
    with log.open("wb") as out:
        full_env = {**os.environ, **(env or {})}
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=full_env
        )
    s = Serve(f"http://127.0.0.1:{port}", proc, log, node_url=f"http://127.0.0.1:{node_port}")
    try:
        wait_ready(s.url, proc, log, timeout=90)
    except AssertionError:
        s.stop(signal.SIGKILL)
        raise
    return s


@pytest.fixture
def serve(tiny_model: Callable[..., str], tmp_path: Path) -> Iterator[Callable[..., Serve]]:
    """`serve(data_dir, slots=2, tenants=None, args=(), env=None)` starts `slotkeeper serve`."""
    started: list[Serve] = []

    def start(data_dir: Path, **options: Any) -> Serve:
        log = tmp_path / f"serve-{options.get('port')}-{len(started)}.log"
        s = start_serve(tiny_model("qwen35"), data_dir, log, **options)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop(signal.SIGKILL if s.proc.poll() is None else signal.SIGTERM, timeout=30)

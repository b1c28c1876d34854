"""The agent CLIs users run (Claude Code, Codex, OpenCode), installed from the npm registry at
pinned versions (tests/support/agent_clis.py), each driven in its non-interactive mode against one
`slotkeeper serve` per test module, behind a recording proxy that notes what every call sent and
what its answer's usage said (tests/support/recording_proxy.py).

The serve runs the tiny random-weight qwen35 (hybrid: reuse past a divergence needs a checkpoint)
with a 128k context — Claude Code's prompt alone is ~46k tokens in its vocabulary — and answers
gibberish: every CLI is capped at a few output tokens so that a turn is quick.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.recording_proxy import RecordingProxy

from gateway.bench.harness.servers import free_port

from ..conftest import start_serve

OUTPUT_TOKENS = 16  # every CLI's output cap, and serve's for a request that sets none
SERVE_ARGS = ("--ctx", "131072", "--default-max-tokens", str(OUTPUT_TOKENS))


@pytest.fixture(scope="module")
def gateway(
    tiny_model: Callable[..., str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RecordingProxy]:
    """One `slotkeeper serve` (4 slots) for the module, and the recording proxy the CLIs talk to."""
    root = tmp_path_factory.mktemp("gateway")
    serve = start_serve(tiny_model("qwen35"), root / "data", root / "serve.log", slots=4, args=SERVE_ARGS)
    proxy = RecordingProxy(serve.url, root / "exchanges.jsonl", free_port())
    try:
        proxy.start()
        yield proxy
    finally:
        proxy.stop()
        serve.stop(signal.SIGKILL)


@dataclass(frozen=True)
class Workspace:
    """Where a module's CLI runs: its project (the working directory) and its own home."""

    project: Path
    home: Path


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    """One project and home per module: a module's sessions share a project, as a user's do."""
    root = tmp_path_factory.mktemp("workspace")
    (root / "project").mkdir()
    (root / "home").mkdir()
    return Workspace(root / "project", root / "home")

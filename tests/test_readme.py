"""The README's promises: it stays a short user's document, and its quickstart works as written.

The quickstart snippets are taken from the README by their `<!-- quickstart:NAME -->` markers and run
against a real `slotkeeper serve` started by the README's own command; only the model path, the port
(through `SLOTKEEPER_PORT`, the variable of `--port`) and the base URL are substituted.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.ready import wait_ready

from gateway.bench.harness.servers import free_port, stop

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BASE_URL = "http://127.0.0.1:8000"  # what the README's snippets call
MODEL_PATH = "/path/to/model.gguf"  # what the README's serve command names


def snippet(name: str) -> str:
    """The fenced block right after `<!-- quickstart:NAME -->`."""
    found = re.search(
        rf"<!-- quickstart:{name} -->\n```[a-z]*\n(.*?)\n```", README.read_text(encoding="utf-8"), re.S
    )
    assert found, f"README.md has no quickstart:{name} block"
    return found.group(1)


def test_the_readme_is_short_and_narrow() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250
    assert max(len(line) for line in lines) <= 200


def test_the_readme_names_the_command_ci_runs() -> None:
    """The README's test command and .ci/run install the same extras and run the same pytest."""
    readme, ci = README.read_text(encoding="utf-8"), (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    for part in ("pip install", "-e '.[test,bench]'", "python3 -m pytest"):
        assert part in readme and part in ci, part


@pytest.fixture
def readme_serve(tiny_model: Callable[..., str], tmp_path: Path) -> Iterator[str]:
    """`slotkeeper serve` as the README starts it, in a scratch directory (its default data dir
    lands there); yields the base URL."""
    command = snippet("serve").split("&&", 1)[1].strip()
    argv = shlex.split(command.replace(MODEL_PATH, tiny_model("qwen35")))
    assert argv[:2] == ["slotkeeper", "serve"], command
    port = free_port(also_plus=1)  # the node agent takes the next port
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", *argv[1:]],
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "SLOTKEEPER_PORT": str(port)},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, log)
        yield url
    finally:
        stop(proc)


@pytest.mark.slow
def test_the_quickstart_snippets_run_against_serve(readme_serve: str, tmp_path: Path) -> None:
    if shutil.which("curl") is None:
        if os.environ.get("CI"):
            pytest.fail("curl is not installed")
        pytest.skip("curl is not installed")
    curl = subprocess.run(
        ["bash", "-c", snippet("curl").replace(BASE_URL, readme_serve)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert curl.returncode == 0, curl.stderr
    head, _, body = curl.stdout.replace("\r\n", "\n").partition("\n\n")
    assert head.startswith("HTTP/1.1 200"), curl.stdout
    assert "x-session-id: readme-curl" in head.lower()
    assert "x-slotkeeper-cache:" in head.lower()
    assert '"chat.completion"' in body

    sdk = subprocess.run(
        [sys.executable, "-c", snippet("python").replace(BASE_URL, readme_serve)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert sdk.returncode == 0, sdk.stderr
    turns = [line.split() for line in sdk.stdout.splitlines()]
    assert len(turns) == 2, sdk.stdout
    (first, first_cached), (second, cached) = turns
    assert (first, first_cached) == ("cold", "0"), sdk.stdout  # a new session, as the README says
    assert second == "live" and int(cached) > 0, sdk.stdout  # the same session, its state reused

"""The README's promises: it stays a short user's document, and its quickstart works as written.

The quickstart is run as a newcomer runs it: the README's two commands, literally, in a fresh virtual
environment (a non-editable `pip install .`, so the source tree's `native/` without its compiled
module sits in the working directory) from the root of a copy of the repository; then its curl and
Python snippets against that `serve`. Only the model path is substituted, and the port and data
directory through their variables (`SLOTKEEPER_PORT`, `SLOTKEEPER_DATA_DIR`). The install compiles
the native module (minutes); llama-cpp-python comes from pip's wheel cache, which the test
environment's own install filled.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import venv
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.ready import wait_ready

from gateway.bench.harness.servers import free_port, stop

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BASE_URL = "http://127.0.0.1:8000"  # what the README's snippets call
MODEL_PATH = "/path/to/model.gguf"  # what the README's serve command names
INSTALL_S = 1800  # a fresh venv's `pip install .`: the native module's compile on two cores


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


def repository_copy(dest: Path) -> Path:
    """The working tree's files as git sees them (tracked, and new ones not ignored), without build
    outputs: what a clone of it would hold."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


@pytest.fixture
def readme_serve(tiny_model: Callable[..., str], tmp_path: Path) -> Iterator[str]:
    """The README's `python3 -m pip install . && slotkeeper serve --model ...`, run by bash in the
    root of a copy of the repository, with a fresh venv's `bin` first on PATH; yields the base URL
    once `/ready` answers."""
    repo = repository_copy(tmp_path / "repo")
    assert (repo / "native" / "CMakeLists.txt").is_file()  # the source tree that could hide the install
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    command = snippet("serve").replace(MODEL_PATH, tiny_model("qwen35"))
    assert command.startswith("python3 -m pip install . && slotkeeper serve --model "), command
    port = free_port(also_plus=1)  # the node agent takes the next port
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLOTKEEPER_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(
        PATH=f"{env_dir / 'bin'}{os.pathsep}{env['PATH']}",
        VIRTUAL_ENV=str(env_dir),
        SLOTKEEPER_PORT=str(port),
        SLOTKEEPER_DATA_DIR=str(tmp_path / "data"),
    )
    log = tmp_path / "readme.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["bash", "-c", command],
            cwd=repo,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, log, timeout=INSTALL_S)
        installed = subprocess.run(
            [str(env_dir / "bin" / "python"), "-c", "import native; print(native.__file__)"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert str(env_dir) in installed.stdout, installed  # the venv's copy, not an editable link
        yield url
    finally:
        stop(proc)
        print(f"--- the README's commands\n{log.read_text(errors='replace')[-4000:]}")


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
        [sys.executable, "-c", snippet("python").replace(BASE_URL, readme_serve)],  # (has openai)
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

"""The image: what the Dockerfile says agrees with the chart (non-root, the `slotkeeper` entry point,
the ports and volumes the chart's values use, the pinned llama-cpp-python), and the image itself,
built here with buildah by .ci/build-image, serves a chat and runs a benchmark.

The built-image test needs root (buildah's chroot isolation, mmdebstrap) and, the first time on a
machine, about a quarter of an hour to compile llama.cpp; it is marked `image` (and `slow`), and CI
runs it (`-m "not image"` leaves it out of a local run).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import yaml
from support.ready import wait_ready

from gateway.bench.harness.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
VALUES = yaml.safe_load((ROOT / "helm" / "slotkeeper" / "values.yaml").read_text())


def final_stage() -> list[tuple[str, str]]:
    """(instruction, arguments) of the Dockerfile's last stage, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    stages: list[list[tuple[str, str]]] = []
    for ln in lines:
        op, _, args = ln.partition(" ")
        if op.upper() == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((op.upper(), args.strip()))
    return stages[-1]


def _args(op: str) -> list[str]:
    return [a for o, a in final_stage() if o == op]


def test_the_runtime_image_runs_slotkeeper_as_a_non_root_user() -> None:
    (user,) = _args("USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) > 0  # numeric, so `runAsNonRoot` can verify it
    assert _args("ENTRYPOINT") == ['["slotkeeper"]']
    assert not any(o == "COPY" and "--from=build" not in a for o, a in final_stage())  # only wheels


def test_the_image_exposes_and_declares_what_the_chart_uses() -> None:
    ports = {int(p) for a in _args("EXPOSE") for p in a.split()}
    assert {VALUES["gateway"]["port"], VALUES["node"]["port"]} <= ports
    volumes: set[str] = set()
    for a in _args("VOLUME"):
        volumes |= set(yaml.safe_load(a))
    wanted = {
        VALUES["gateway"]["dataDir"],
        VALUES["node"]["dataDir"],
        VALUES["node"]["modelVolume"]["mountPath"],
    }
    assert wanted <= volumes
    assert VALUES["image"]["repository"] == "slotkeeper"


def test_the_image_builds_the_pinned_llama_cpp_python_and_ships_no_checkout_clutter() -> None:
    pinned = re.search(r'"llama-cpp-python==([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert pinned is not None
    assert f"llama-cpp-python=={pinned.group(1)}" in (ROOT / "Dockerfile").read_text()
    ignored = {ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.strip()}
    assert {".git", "tests", "**/*.gguf"} <= ignored
    copied = {a.split()[0] for _, a in _build_copies()}
    assert not copied & ignored  # nothing the build copies is ignored


def _build_copies() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    return [
        ("COPY", ln.strip()[5:])
        for ln in text.splitlines()
        if ln.strip().startswith("COPY ") and "--from" not in ln
    ]


def test_both_stages_start_from_the_base_argument_the_official_image_by_default() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.findall(r"^ARG BASE=(\S+)$", text, re.M) == ["python:3.11-slim-bookworm"]
    assert re.findall(r"^FROM (\S+)", text, re.M) == ["${BASE}", "${BASE}"]
    assert "x86-64-v3" in text and "-DGGML_NATIVE=OFF" in text  # portable, not this CPU's


# -- the image itself: built with buildah, run as uid 1000 -----------------------------------------
TAG = "slotkeeper:test"
BUILD_TIMEOUT_S = 45 * 60  # a first build compiles llama.cpp: about a quarter of an hour on 2 cores
IMAGE_UID = 1000


def _needs_root() -> None:
    if os.geteuid() != 0:  # buildah's chroot isolation and mmdebstrap's root mode
        if os.environ.get("CI"):
            pytest.fail("the image test needs root")
        pytest.skip("the image test needs root")


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """slotkeeper:test built from this tree (.ci/build-image keeps an image of the same tree)."""
    _needs_root()
    log = tmp_path_factory.mktemp("image") / "build.log"
    with log.open("wb") as out:
        proc = subprocess.run(
            [str(ROOT / ".ci" / "build-image"), TAG],
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=BUILD_TIMEOUT_S,
        )
    assert proc.returncode == 0, f".ci/build-image exited {proc.returncode}:\n{log.read_text()[-6000:]}"
    return TAG


@dataclass
class Container:
    """A working container of the image; `run` starts a command in it as the image's user."""

    name: str
    mounts: dict[Path, str]

    def command(self, *argv: str) -> list[str]:
        # chroot isolation shares the host's network (and PID) namespace: ports are the host's.
        cmd = ["buildah", "run", "--isolation", "chroot", "--network", "host"]
        cmd += ["--user", f"{IMAGE_UID}:{IMAGE_UID}"]
        for host, inside in self.mounts.items():
            cmd += ["--volume", f"{host}:{inside}"]
        return [*cmd, self.name, "--", *argv]


@contextmanager
def container(image: str, mounts: dict[Path, str]) -> Iterator[Container]:
    name = f"slotkeeper-test-{os.getpid()}"
    subprocess.run(["buildah", "rm", name], capture_output=True)  # a leftover of a killed run
    subprocess.run(
        ["buildah", "from", "--pull=never", "--name", name, image], check=True, capture_output=True
    )
    # A mount over one of the image's VOLUMEs replaces it, as `docker run -v` does. buildah (1.28)
    # mounts both at the same path, and which one ends up on top varies from run to run: the
    # working container drops the VOLUMEs that get a mount.
    unvolume = [f"--volume={inside.split(':')[0]}-" for inside in mounts.values()]
    subprocess.run(["buildah", "config", *unvolume, name], check=True, capture_output=True)
    try:
        yield Container(name, mounts)
    finally:
        subprocess.run(["buildah", "rm", name], capture_output=True)


def _data_volume(path: Path) -> Path:
    """A directory the image's user owns, as the chart's volumes are (fsGroup)."""
    path.mkdir()
    os.chown(path, IMAGE_UID, IMAGE_UID)
    return path


def _model_volume(path: Path, model: Path) -> Path:
    """A directory holding `model` that the image's user can read (pytest's own are root's, 0700)."""
    path.mkdir(mode=0o755)
    shutil.copyfile(model, path / model.name)
    (path / model.name).chmod(0o644)
    return path


@pytest.mark.slow
@pytest.mark.image
def test_the_image_serves_a_chat_and_runs_bench_resume_as_uid_1000(
    image: str, tiny_model: Callable[..., str], tmp_path: Path
) -> None:
    model = Path(tiny_model("qwen35"))
    data = _data_volume(tmp_path / "data")
    mounts = {_model_volume(tmp_path / "models", model): "/models:ro", data: "/var/lib/slotkeeper"}
    port, node_port = free_port(), free_port()
    with container(image, mounts) as ctr:
        # `buildah run` answers SIGTERM by killing its command: serve writes its pid (the host's,
        # no PID namespace) so that it gets the SIGTERM itself and stops its engines.
        serve = ctr.command(
            *("sh", "-c", 'echo $$ > /var/lib/slotkeeper/serve.pid && exec slotkeeper "$@"', "serve"),
            "serve",
            *("--model", f"/models/{model.name}"),
            *("--port", str(port), "--node-port", str(node_port)),
            *("--slots", "1", "--ctx", "2048"),
            *("--log-level", "warning"),
        )
        log = tmp_path / "serve.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(serve, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, proc, log)
            with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60) as client:
                chat = client.chat.completions.create(
                    model=model.stem,
                    messages=[{"role": "user", "content": "Hello from inside the image"}],
                    max_tokens=8,
                    temperature=0,
                )
            assert chat.choices[0].message.content
            assert chat.usage is not None and chat.usage.completion_tokens > 0
        finally:
            _stop(proc, data / "serve.pid")
        assert proc.returncode == 0, log.read_text()[-3000:]
        written = [p for p in data.rglob("*") if p.name != "serve.pid"]
        assert written and all(p.stat().st_uid == IMAGE_UID for p in written)  # the data volume only

        bench = ctr.command(
            *("slotkeeper", "bench", "resume"),
            *("--model", f"/models/{model.name}"),
            *("--tokens", "600", "--ctx", "2048", "--n-predict", "4", "--threads", "2"),
            *("--json", "/var/lib/slotkeeper/resume.json"),
        )
        done = subprocess.run(bench, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        report = json.loads((data / "resume.json").read_text())
        assert report["in_process"]["restored_tokens_equal_live"] is True


def _stop(proc: subprocess.Popen[bytes], pid_file: Path) -> None:
    if proc.poll() is None and pid_file.exists():
        os.kill(int(pid_file.read_text()), signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

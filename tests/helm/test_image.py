"""The Dockerfile and the chart agree: the image the chart runs by default is what the Dockerfile
builds — non-root, the `slotkeeper` entry point, the ports and volumes the chart's values use, the
pinned llama-cpp-python. (The image itself has never been built here: no Docker daemon.)"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

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

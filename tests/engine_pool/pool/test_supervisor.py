"""EngineSupervisor: real engine processes (tiny qwen35) and small stand-in scripts on loopback.

Transitions are asserted through their `engine.transition` log events, in order.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from engine_pool.pool.supervisor import EngineSpec, EngineSupervisor, State, SupervisorPolicy

# A stand-in engine: /health answers 200 until the file `sick` exists (then 500), or never
# ("never-healthy"); "ignore-term" ignores SIGTERM and leaves a child in its group that does too.
FAKE = r"""
import http.server, os, signal, subprocess, sys
port, sick, mode, pidfile = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the child across exec
    child = subprocess.Popen(["sleep", "600"])
    open(pidfile, "w").write(str(child.pid))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        bad = mode == "never-healthy" or os.path.exists(sick)
        self.send_response(503 if bad else 200)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""

FAST = SupervisorPolicy(
    start_timeout_s=30, health_interval_s=0.2, health_timeout_s=1, health_failures=2, stop_grace_s=10,
    backoff_base_s=0.1, backoff_max_s=0.4, stable_s=60,
)  # fmt: skip


def transitions(logs: list[dict[str, Any]], engine: str = "n-e0") -> list[tuple[str, str]]:
    return [(e["from"], e["to"]) for e in logs if e["event"] == "engine.transition" and e["engine"] == engine]


def spec(tmp_path: Path, model: str, **kw: Any) -> EngineSpec:
    return EngineSpec(
        engine_id="n-e0", model=model, model_id="tiny", n_slots=1, n_ctx=256, slot_dir=tmp_path / "slots",
        log_path=tmp_path / "engine.log", extra_args=("-t", "1"), **kw,
    )  # fmt: skip


def fake_argv(tmp_path: Path, mode: str) -> Callable[[int, str], list[str]]:
    script = tmp_path / "fake_engine.py"
    script.write_text(FAKE)
    return lambda port, instance: [sys.executable, str(script), str(port), str(tmp_path / "sick"), mode,
                         str(tmp_path / "child.pid")]  # fmt: skip


@pytest.fixture
async def running() -> AsyncIterator[Callable[[EngineSupervisor], EngineSupervisor]]:
    """Runs supervisors' loops in tasks; whatever is still running at the end is cancelled (killed)."""
    tasks: list[asyncio.Task[None]] = []

    def run(sup: EngineSupervisor) -> EngineSupervisor:
        tasks.append(asyncio.create_task(sup.run()))
        sup.start()
        return sup

    yield run
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its new parent to reap it counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def test_engine_ready_killed_restarted_and_stopped(
    tmp_path: Path, tiny_model: Callable[..., str], running: Any
) -> None:
    with capture_logs() as logs:
        sup = running(EngineSupervisor(spec(tmp_path, tiny_model("qwen35")), FAST))
        first = await sup.wait_for(State.READY, timeout_s=60)
        assert first.pid and first.url and first.restarts == 0
        os.killpg(first.pid, signal.SIGKILL)
        crashed = await sup.wait_for(State.CRASHED, timeout_s=10)
        assert "exited with code -9" in crashed.last_error
        second = await sup.wait_for(State.READY, timeout_s=60)
        assert second.pid != first.pid and second.restarts == 1
        # Every process has an instance id of its own, and answers only requests naming its own.
        assert first.instance and second.instance and first.instance != second.instance
        body = {"prompt": "hi", "n_predict": 1, "id_slot": 0}
        async with httpx.AsyncClient(base_url=second.url or "", timeout=30) as c:
            late = await c.post("/completion", json=body, headers={"X-Slotkeeper-Instance": first.instance})
            assert late.status_code == 409 and late.json()["error"]["code"] == "engine_instance_changed"
            now = await c.post("/completion", json=body, headers={"X-Slotkeeper-Instance": second.instance})
            assert now.status_code == 200, now.text
        stopped = await sup.stop()
        assert stopped.instance == ""  # no process, no instance
        assert stopped.last_exit == 0 and stopped.pid is None
    assert transitions(logs) == [
        ("stopped", "starting"), ("starting", "ready"), ("ready", "crashed"), ("crashed", "starting"),
        ("starting", "ready"), ("ready", "draining"), ("draining", "stopped"),
    ]  # fmt: skip
    assert not alive(second.pid or 0)


async def test_bad_model_crashes_with_log_tail_and_growing_backoff(tmp_path: Path, running: Any) -> None:
    with capture_logs() as logs:
        sup = running(EngineSupervisor(spec(tmp_path, str(tmp_path / "missing.gguf")), FAST))
        for _ in range(3):
            await sup.wait_for(State.CRASHED, timeout_s=30)
            await sup.wait_for(State.STARTING, timeout_s=10)
        snap = sup.snapshot()
        assert "exited with code 1 while starting" in snap.last_error
        assert "not a readable GGUF file" in snap.last_error  # the engine's own words, from its log
        await sup.stop()
    delays = [e["retry_in_s"] for e in logs if e["event"] == "engine.transition" and e["to"] == "crashed"]
    assert delays[:3] == [0.1, 0.2, 0.4]
    assert transitions(logs)[-1] in {("crashed", "stopped"), ("draining", "stopped")}


async def test_stop_escalates_to_sigkill_of_the_whole_group(tmp_path: Path, running: Any) -> None:
    policy = SupervisorPolicy(stop_grace_s=0.5, health_interval_s=60)
    with capture_logs() as logs:
        sup = running(
            EngineSupervisor(spec(tmp_path, "unused"), policy, argv=fake_argv(tmp_path, "ignore-term"))
        )
        ready = await sup.wait_for(State.READY, timeout_s=20)
        child = int((tmp_path / "child.pid").read_text())
        assert alive(child)
        stopped = await sup.stop()
    assert stopped.last_exit == -signal.SIGKILL
    stop_event = [e for e in logs if e["event"] == "engine.transition" and e["to"] == "stopped"][0]
    assert "still running 0.5 s after SIGTERM" in stop_event["reason"]
    assert not alive(ready.pid or 0)
    for _ in range(100):  # the signal may take a moment to land
        if not alive(child):
            break
        await asyncio.sleep(0.02)
    assert not alive(child)


async def test_failing_health_checks_get_the_engine_restarted(tmp_path: Path, running: Any) -> None:
    with capture_logs() as logs:
        sup = running(EngineSupervisor(spec(tmp_path, "unused"), FAST, argv=fake_argv(tmp_path, "ok")))
        first = await sup.wait_for(State.READY, timeout_s=20)
        (tmp_path / "sick").touch()
        crashed = await sup.wait_for(State.CRASHED, timeout_s=10)
        assert "2 health checks failed" in crashed.last_error
        (tmp_path / "sick").unlink()
        second = await sup.wait_for(State.READY, timeout_s=20)
        assert second.pid != first.pid and second.url != first.url
        await sup.stop()
    assert transitions(logs)[:5] == [
        ("stopped", "starting"), ("starting", "ready"), ("ready", "crashed"), ("crashed", "starting"),
        ("starting", "ready"),
    ]  # fmt: skip


async def test_start_deadline(tmp_path: Path, running: Any) -> None:
    policy = SupervisorPolicy(start_timeout_s=0.5, backoff_base_s=5)
    sup = running(
        EngineSupervisor(spec(tmp_path, "unused"), policy, argv=fake_argv(tmp_path, "never-healthy"))
    )
    crashed = await sup.wait_for(State.CRASHED, timeout_s=20)
    assert crashed.last_error.startswith("not healthy within 0.5 s")
    assert (await sup.stop()).state is State.STOPPED  # during the backoff: no process left to stop

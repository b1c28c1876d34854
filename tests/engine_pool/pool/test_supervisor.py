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
from support.bad_models import unloadable_model

from engine_pool.pool.supervisor import (
    EngineSpec,
    EngineSupervisor,
    State,
    SupervisorPolicy,
    engine_error,
    failed_starts,
    load_progress,
    read_tail,
)

# A stand-in engine: /health answers 200 until the file `sick` exists (then 500), or never
# ("never-healthy"); "ignore-term" ignores SIGTERM and leaves a child in its group that does too;
# "fail-anew" logs a new error at every start and exits.
FAKE = r"""
import http.server, os, signal, subprocess, sys
port, sick, mode, pidfile = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
if mode == "fail-anew":  # a different error at every start
    runs = pidfile + ".runs"
    n = (int(open(runs).read()) if os.path.exists(runs) else 0) + 1
    open(runs, "w").write(str(n))
    print('{"error": "boom %d", "event": "engine.load_failed", "level": "error"}' % n, flush=True)
    sys.exit(3)
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the child across exec
    child = subprocess.Popen(["sleep", "600"])
    open(pidfile, "w").write(str(child.pid))
polls = [0]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if mode == "loading" and polls[0] < 4:  # a quarter of the weights more at each poll
            polls[0] += 1
            body = b'{"error": {"message": "Loading model"}, "progress": %.2f}' % (polls[0] / 4)
            self.send_response(503)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)
            return
        bad = mode == "never-healthy" or os.path.exists(sick)
        self.send_response(503 if bad else 200)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""

FAST = SupervisorPolicy(
    start_timeout_s=30,
    health_interval_s=0.2,
    health_timeout_s=1,
    health_failures=2,
    stop_grace_s=10,
    backoff_base_s=0.1,
    backoff_max_s=0.4,
    stable_s=60,
)


def transitions(logs: list[dict[str, Any]], engine: str = "n-e0") -> list[tuple[str, str]]:
    return [(e["from"], e["to"]) for e in logs if e["event"] == "engine.transition" and e["engine"] == engine]


def spec(tmp_path: Path, model: str, **kw: Any) -> EngineSpec:
    return EngineSpec(
        engine_id="n-e0",
        model=model,
        model_id="tiny",
        n_slots=1,
        n_ctx=256,
        slot_dir=tmp_path / "slots",
        log_path=tmp_path / "engine.log",
        extra_args=("-t", "1"),
        **kw,
    )


def fake_argv(tmp_path: Path, mode: str) -> Callable[[int, str], list[str]]:
    script = tmp_path / "fake_engine.py"
    script.write_text(FAKE)
    return lambda port, instance: [
        sys.executable,
        str(script),
        str(port),
        str(tmp_path / "sick"),
        mode,
        str(tmp_path / "child.pid"),
    ]


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
        ("stopped", "starting"),
        ("starting", "ready"),
        ("ready", "crashed"),
        ("crashed", "starting"),
        ("starting", "ready"),
        ("ready", "draining"),
        ("draining", "stopped"),
    ]
    assert not alive(second.pid or 0)


async def test_a_loading_engine_shows_its_progress_on_the_console(tmp_path: Path, running: Any) -> None:
    with capture_logs() as logs:
        sup = running(EngineSupervisor(spec(tmp_path, "unused"), FAST, argv=fake_argv(tmp_path, "loading")))
        await sup.wait_for(State.READY, timeout_s=30)
        await sup.stop()
    shown = [e["percent"] for e in logs if e["event"] == "engine.loading"]
    assert shown == [20, 50, 70, 100]


def test_load_progress_is_read_only_from_a_loading_engines_body() -> None:
    def answer(status: int, body: object) -> httpx.Response:
        return httpx.Response(status, json=body)

    assert load_progress(answer(503, {"error": {}, "progress": 0.4})) == 0.4
    assert load_progress(answer(503, {"error": {}, "progress": 7})) is None  # out of range
    assert load_progress(answer(503, {"error": {}, "progress": "half"})) is None
    assert load_progress(answer(503, ["not", "a", "dict"])) is None
    assert load_progress(answer(200, {"progress": 0.4})) is None
    assert load_progress(httpx.Response(503, content=b"<html>")) is None


async def test_a_missing_model_fails_its_starts_without_a_process_and_is_given_up(
    tmp_path: Path, running: Any
) -> None:
    missing = str(tmp_path / "missing.gguf")
    with capture_logs() as logs:
        sup = running(EngineSupervisor(spec(tmp_path, missing), FAST))
        failed = await sup.wait_for(State.FAILED, timeout_s=30)
        assert failed.error == f"model {missing}: does not exist"
        assert failed.pid is None and failed.restarts == 2
        await sup.stop()
    assert not [e for e in logs if e["event"] == "engine.spawned"]  # the check came first, every time
    assert transitions(logs) == [
        ("stopped", "starting"),
        ("starting", "crashed"),
        ("crashed", "starting"),
        ("starting", "crashed"),
        ("crashed", "starting"),
        ("starting", "failed"),
        ("failed", "stopped"),
    ]
    moves = [e for e in logs if e["event"] == "engine.transition"]
    assert [e["retry_in_s"] for e in moves if e["to"] == "crashed"] == [0.1, 0.2]
    gave_up = [e for e in moves if e["to"] == "failed"]
    assert [e["reason"] for e in gave_up] == [
        f"gave up after 3 failed starts in a row: model {missing}: does not exist"
    ]


async def test_an_engine_that_fails_to_load_says_why_and_is_given_up(tmp_path: Path, running: Any) -> None:
    model = unloadable_model(tmp_path / "alien.gguf")
    with capture_logs() as logs:
        sup = running(EngineSupervisor(spec(tmp_path, model), FAST))
        failed = await sup.wait_for(State.FAILED, timeout_s=120)
        await sup.stop()
    # The engine's own error, from its log, in the one line the console shows; the tail in last_error.
    said = f"the model failed to load: ModelLoadError: llama.cpp could not load the model: {model}"
    assert (
        failed.error
        == f"exited with code 1 while starting: {said} (llama.cpp: unknown model architecture: 'notanarch')"
    )
    assert failed.last_error.startswith(failed.error + "\nlast output:\n")
    assert "engine.load_failed" in failed.last_error and "--- slotkeeper: run" not in failed.last_error
    assert len([e for e in logs if e["event"] == "engine.spawned"]) == 3
    moves = [e for e in logs if e["event"] == "engine.transition" and e["to"] in ("crashed", "failed")]
    assert [e["to"] for e in moves] == ["crashed", "crashed", "failed"]
    assert all(e["reason"].endswith(failed.error) and e["returncode"] == 1 for e in moves)


async def test_a_start_failing_differently_each_time_is_retried(tmp_path: Path, running: Any) -> None:
    """A new error is a new cause: only the same failure `give_up_after` times in a row gives up."""
    policy = SupervisorPolicy(backoff_base_s=0.05, backoff_max_s=0.05, give_up_after=2)
    with capture_logs() as logs:
        sup = running(
            EngineSupervisor(spec(tmp_path, "unused"), policy, argv=fake_argv(tmp_path, "fail-anew"))
        )
        for _ in range(4):
            await sup.wait_for(State.CRASHED, timeout_s=20)
            await sup.wait_for(State.STARTING, State.FAILED, timeout_s=20)
        assert sup.state is State.STARTING
        await sup.stop()
    errors = [e["reason"] for e in logs if e["event"] == "engine.transition" and e["to"] == "crashed"]
    assert errors[:2] == [
        "exited with code 3 while starting: boom 1",
        "exited with code 3 while starting: boom 2",
    ]


async def test_a_failed_engine_starts_again_when_asked(tmp_path: Path, running: Any) -> None:
    fixed = tmp_path / "fixed"
    check = lambda model: None if fixed.exists() else "is not a GGUF file (it starts with b'<htm')"  # noqa: E731
    with capture_logs() as logs:
        sup = running(
            EngineSupervisor(
                spec(tmp_path, "m.gguf"), FAST, argv=fake_argv(tmp_path, "ok"), check_model=check
            )
        )
        failed = await sup.wait_for(State.FAILED, timeout_s=20)
        assert failed.error == "model m.gguf: is not a GGUF file (it starts with b'<htm')"
        fixed.touch()
        sup.start()
        ready = await sup.wait_for(State.READY, timeout_s=20)
        assert ready.error == failed.error  # the last failure stays on record
        await sup.stop()
    assert transitions(logs)[5:] == [
        ("starting", "failed"),
        ("failed", "starting"),
        ("starting", "ready"),
        ("ready", "draining"),
        ("draining", "stopped"),
    ]


@pytest.mark.parametrize(
    ("output", "said"),
    [
        (
            '{"event": "engine.loading", "level": "info"}\n'
            '{"error": "the model failed to load: X", "event": "engine.load_failed", "level": "error"}\n'
            '{"event": "Shutting down", "level": "info"}\n'
            '{"reason": "the model failed to load: X", "event": "engine.exit", "level": "error"}',
            "the model failed to load: X",
        ),
        (
            'Traceback (most recent call last):\n  File "x.py", line 1\nImportError: no libllama',
            "ImportError: no libllama",
        ),
        ('{"event": "boom", "level": "error"}', "boom"),
        ('--- slotkeeper: run 1: old\n{"error": "old", "level": "error"}\n--- slotkeeper: run 2: new\n', ""),
        ("", ""),
    ],
)
def test_engine_error_is_the_last_error_of_this_run(tmp_path: Path, output: str, said: str) -> None:
    log = tmp_path / "engine.log"
    log.write_text(output)
    assert engine_error(read_tail(log, 30)) == said


def test_failed_starts_count_one_error_in_a_row() -> None:
    streak = ("", 0)
    for error, n in [("a", 1), ("a", 2), ("b", 1), ("b", 2), ("b", 3), ("a", 1)]:
        streak = failed_starts(streak, error)
        assert streak == (error, n)


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
        ("stopped", "starting"),
        ("starting", "ready"),
        ("ready", "crashed"),
        ("crashed", "starting"),
        ("starting", "ready"),
    ]


async def test_a_probe_that_fails_outside_httpxs_errors_is_only_an_unhealthy_answer(
    tmp_path: Path, running: Any
) -> None:
    """httpcore can fail outside httpx's errors when the socket closes as it connects (anyio's peer
    name: an AttributeError). The probe loop lives on: the engine becomes ready once it answers."""

    class Flaky(httpx.AsyncBaseTransport):
        def __init__(self) -> None:
            self.inner, self.broken = httpx.AsyncHTTPTransport(), 3

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if self.broken:
                self.broken -= 1
                raise AttributeError("'NoneType' object has no attribute 'getpeername'")
            return await self.inner.handle_async_request(request)

    flaky = Flaky()
    async with httpx.AsyncClient(transport=flaky) as http:
        sup = running(
            EngineSupervisor(spec(tmp_path, "unused"), FAST, argv=fake_argv(tmp_path, "ok"), http=http)
        )
        assert (await sup.wait_for(State.READY, timeout_s=20)).pid
        assert flaky.broken == 0
        await sup.stop()


async def test_an_exited_engine_is_never_ready_without_its_process(
    tmp_path: Path, running: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reading the dead engine's log tail takes a while; a router looking meanwhile must not find
    # a ready engine whose process (and soon its address) is gone.
    import engine_pool.pool.supervisor as supervisor_module

    seen: list[Any] = []
    sup = running(EngineSupervisor(spec(tmp_path, "unused"), FAST, argv=fake_argv(tmp_path, "ok")))

    def reading(path: Path, lines: int, max_bytes: int = 16384) -> str:
        seen.append(sup.snapshot())
        return read_tail(path, lines, max_bytes)

    monkeypatch.setattr(supervisor_module, "read_tail", reading)
    first = await sup.wait_for(State.READY, timeout_s=20)
    assert first.pid
    os.killpg(first.pid, signal.SIGKILL)
    crashed = await sup.wait_for(State.CRASHED, timeout_s=10)
    # (The first read: the engine's facts, as it became ready.)
    assert [(s.state, s.pid) for s in seen] == [(State.STARTING, first.pid), (State.READY, first.pid)]
    assert crashed.pid is None and crashed.last_exit == -9
    await sup.stop()


async def test_start_deadline(tmp_path: Path, running: Any) -> None:
    policy = SupervisorPolicy(start_timeout_s=0.5, backoff_base_s=5)
    sup = running(
        EngineSupervisor(spec(tmp_path, "unused"), policy, argv=fake_argv(tmp_path, "never-healthy"))
    )
    crashed = await sup.wait_for(State.CRASHED, timeout_s=20)
    assert crashed.last_error.startswith("not healthy within 0.5 s")
    assert (await sup.stop()).state is State.STOPPED  # during the backoff: no process left to stop

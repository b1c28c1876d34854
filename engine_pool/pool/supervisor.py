"""One engine process under supervision: a small state machine whose only owner is its run loop.

    stopped ──start──▶ starting ──healthy──▶ ready ──stop──▶ draining ──exit──▶ stopped
                          │  ▲                 │                 (SIGTERM, grace, SIGKILL)
        exit / no health  │  │ backoff         │ exit / health checks failing (killed)
                          ▼  │                 ▼
                         crashed ◀─────────────┘        crashed ──stop──▶ stopped
                          │
        the Nth failed start in a row with the same error: starting ──▶ failed (no restart;
        `start()` tries again, `stop()` stops)

`TRANSITIONS` is the table; `_transition` refuses anything else (a bug, not a runtime condition).
Everything that happens to the engine — a start or stop request, a health probe's result, the
process's exit, a timer — is a message in the supervisor's inbox, and `run()` handles them one at
a time. Helper tasks (the exit watcher, the health prober, timers) only post messages tagged with
the number of the process they watch, so a late message about an earlier process is ignored.
Nothing outside `run()` changes the state; callers read `snapshot()` and send messages.

Before every spawn the model file is checked (`model_check`): a file that is gone or is no GGUF
fails the start without a process. A process is spawned in its own session (its own process group)
with stdout and stderr appended to a log file; when it dies, the last error it logged is the cause
(`engine_error`), and the last lines of its output go into `last_error`. Stopping is SIGTERM to the
group, then SIGKILL after the grace period. Crashes are restarted after an exponential backoff
(capped) whose exponent resets once a process has stayed ready for `stable_s` — except a start
that failed `give_up_after` times in a row with the same error, which no retry will mend: the
engine stays `failed`, saying why, until asked to start again.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import httpx
import structlog

from .model_check import model_problem

log = structlog.get_logger("engine.supervisor")


class State(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    CRASHED = "crashed"
    FAILED = "failed"  # gave up: the same failed start, `give_up_after` times in a row


TRANSITIONS: Mapping[State, frozenset[State]] = {
    State.STOPPED: frozenset({State.STARTING}),
    State.STARTING: frozenset({State.READY, State.CRASHED, State.DRAINING, State.FAILED}),
    State.READY: frozenset({State.DRAINING, State.CRASHED}),
    State.DRAINING: frozenset({State.STOPPED}),
    State.CRASHED: frozenset({State.STARTING, State.STOPPED}),
    State.FAILED: frozenset({State.STARTING, State.STOPPED}),
}


# The level each transition is logged at: what a person at the console must see stands out —
# a crash (restarted after a backoff) is a warning, giving up is an error; the rest is routine.
LEVELS: Mapping[State, str] = {
    State.STOPPED: "info",
    State.STARTING: "info",
    State.READY: "info",
    State.DRAINING: "info",
    State.CRASHED: "warning",
    State.FAILED: "error",
}


@dataclass(frozen=True)
class EngineSpec:
    """What to run: one model, its slots, where its slot files and its log go."""

    engine_id: str
    model: str
    model_id: str
    n_slots: int
    n_ctx: int  # total context of the engine (all slots)
    slot_dir: Path
    log_path: Path
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port for every process
    extra_args: tuple[str, ...] = ()
    n_gpu_layers: int = 0  # llama-server's -ngl: layers offloaded to the GPU (a CUDA build)
    flash_attn: str = "auto"  # on | off | auto: auto leaves the engine's own default
    # The process environment (credentials.engine_environment: the node's, less its settings and
    # secrets, plus the engine's API key); None inherits the supervisor's (tests).
    env: tuple[tuple[str, str], ...] | None = None
    role: str = "mixed"  # prefill | decode | mixed (engine_pool.protocol.handoff)


@dataclass(frozen=True)
class SupervisorPolicy:
    start_timeout_s: float = 120.0
    start_poll_s: float = 0.1
    health_interval_s: float = 5.0
    health_timeout_s: float = 3.0
    health_failures: int = 3  # consecutive failed checks that get a ready engine killed
    stop_grace_s: float = 20.0
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    stable_s: float = 60.0  # ready this long: the next crash starts the backoff from the beginning
    log_tail_lines: int = 30
    give_up_after: int = 3  # failed starts in a row with the same error that leave it failed (0: never)


@dataclass(frozen=True)
class EngineSnapshot:
    """A read-only view of one supervised engine."""

    engine_id: str
    model_id: str
    n_slots: int
    state: State
    pid: int | None
    url: str | None
    restarts: int
    last_error: str  # why it last failed, then the end of its output
    last_exit: int | None
    instance: str = ""  # the current process's instance id (new at every start)
    error: str = ""  # one line: why it last failed (the engine's own last error where it logged one)
    role: str = "mixed"  # prefill | decode | mixed


# -- messages to the owner ---------------------------------------------------------------------
@dataclass(frozen=True)
class Start:
    pass


@dataclass(frozen=True)
class Stop:
    reason: str = "stop requested"


@dataclass(frozen=True)
class Notice:
    """From a helper of process `run`: healthy | start_timeout | grace_over | restart_due."""

    run: int
    what: str


@dataclass(frozen=True)
class Probe:
    run: int
    ok: bool
    error: str = ""


@dataclass(frozen=True)
class Exited:
    run: int
    returncode: int


Message = Start | Stop | Notice | Probe | Exited


def engine_argv(spec: EngineSpec, port: int, instance: str) -> list[str]:
    """The `slotkeeper engine` command line of a spec (llama-server's flags). `--metrics`: an engine
    serves /metrics only when asked (llama-server's default); a node's engines keep theirs (reuse
    counters per source, checkpoints, process start time) for whoever reads them. `--instance-id`:
    new for every process, registered with it, so that a request naming it never runs on a later
    process of the same engine (whose slots hold other sessions)."""
    options = [
        ("-m", spec.model),
        ("--host", spec.host),
        ("--port", str(port)),
        ("-np", str(spec.n_slots)),
        ("-c", str(spec.n_ctx)),
        ("--slot-save-path", str(spec.slot_dir)),
        ("-a", spec.model_id),
        ("--role", spec.role),
    ]
    if spec.n_gpu_layers:
        options.append(("-ngl", str(spec.n_gpu_layers)))
    if spec.flash_attn != "auto":
        options.append(("-fa", spec.flash_attn))
    return [
        # -P: the working directory is not put first on sys.path, so that a source tree there (the
        # repository root, whose native/ has no compiled module) cannot hide the installed package.
        *(sys.executable, "-P", "-m", "gateway.cli", "engine"),
        *(arg for option in options for arg in option),
        *("--metrics", "--exit-with-parent"),
        *("--log-format", "json"),  # (its log file is read back: `engine_error`)
        *spec.extra_args,
        *("--instance-id", instance),
    ]


def free_port(host: str) -> int:
    """A port nobody listens on now (a race with other processes ends as a crash and a retry)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


RUN_HEADER = "--- slotkeeper: run "  # the line `_open_log` writes before each process's output
_ERROR_LEVELS = frozenset({"error", "critical", "exception"})
_ERROR_FIELDS = ("error", "reason", "message")  # where an event says what went wrong, in this order
_LLAMA_LOAD_ERROR = re.compile(r"error loading model: (.+)")  # llama_model_load's reason, on stderr


def read_tail(path: Path, lines: int, max_bytes: int = 16384) -> str:
    """The last `lines` lines of the current process's output (none of an earlier run's)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", "replace").splitlines()
    starts = [i for i, line in enumerate(text) if line.startswith(RUN_HEADER)]
    return "\n".join(text[starts[-1] + 1 if starts else 0 :][-lines:])


def engine_error(output: str) -> str:
    """The last error an engine logged, in one line: the `error` (else `reason`, `message`) of its
    last JSON line at level error, e.g. `engine.load_failed`, with llama.cpp's own reason when its
    loader printed one (the engine's error only says that the load failed); without a JSON error,
    its last line that is not JSON (a traceback's last line); '' when it said nothing."""
    plain, native, said = "", "", ""
    for line in reversed(output.splitlines()):
        line = line.strip()
        if not line or line.startswith(RUN_HEADER):
            continue
        try:
            event = json.loads(line)
        except ValueError:
            plain = plain or line
            found = _LLAMA_LOAD_ERROR.search(line)
            native = native or (found.group(1) if found else "")
            continue
        if not said and isinstance(event, dict) and str(event.get("level", "")).lower() in _ERROR_LEVELS:
            text = next((event[f] for f in _ERROR_FIELDS if isinstance(event.get(f), str) and event[f]), None)
            said = str(text or event.get("event", ""))
    if not said:
        return " ".join(plain.split())
    return " ".join(f"{said} (llama.cpp: {native})".split() if native else said.split())


# engine log event -> (its field, the name it gets in the node's ready line)
_FACTS = {
    "engine.chat_template": ("origin", "chat_template"),
    "engine.chat_template_fallback": ("reason", "chat_template_fallback"),
    "engine.chat_format": ("format", "chat_format"),
}
FALLBACK_ORIGIN = "chatml-fallback"  # (engine_pool.server.chat_template: no usable template in the GGUF)


def engine_facts(output: str) -> dict[str, str]:
    """The chat template's origin and the chat format an engine logged while it loaded (the last
    of each in `output`, its current run's log)."""
    facts: dict[str, str] = {}
    for line in output.splitlines():
        if '"engine.chat_' not in line:
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        fact = _FACTS.get(event.get("event", "")) if isinstance(event, dict) else None
        if fact is not None and isinstance(event.get(fact[0]), str):
            facts[fact[1]] = event[fact[0]]
    return facts


def load_progress(response: httpx.Response) -> float | None:
    """How far a loading engine's weights are, from its 503 `/health` body (0..1), or None where the
    body does not say (another server, or an engine that is not loading)."""
    if response.status_code != 503:
        return None
    try:
        value = response.json().get("progress")
    except (ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) and 0 <= value <= 1 else None


def failed_starts(streak: tuple[str, int], error: str) -> tuple[str, int]:
    """The run of failed starts with one error, after one more start failed with `error`: a new
    error starts a new run (the cause changed, so a retry may mend it)."""
    cause, n = streak
    return error, n + 1 if error == cause else 1


class EngineSupervisor:
    """Runs and restarts one engine process. Drive it with `run()` in a task, `start()`, `stop()`."""

    def __init__(
        self,
        spec: EngineSpec,
        policy: SupervisorPolicy | None = None,
        *,
        argv: Callable[[int, str], Sequence[str]] | None = None,
        http: httpx.AsyncClient | None = None,
        on_transition: Callable[[EngineSnapshot], None] | None = None,
        check_model: Callable[[str], str | None] | None = None,
    ) -> None:
        self.spec = spec
        self.policy = policy or SupervisorPolicy()
        self._argv = argv or (lambda port, instance: engine_argv(spec, port, instance))
        # The model is checked before `slotkeeper engine` is spawned; an injected command (tests'
        # stand-ins) is checked only with an injected check.
        self._check_model = check_model or (model_problem if argv is None else None)
        self._http = http
        self._on_transition = on_transition  # called by the owner; must not block
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._changed = asyncio.Event()
        # Owned by run() alone:
        self._state = State.STOPPED
        self._closing = False
        self._run = 0  # number of the current process; helpers tag their messages with it
        self._proc: asyncio.subprocess.Process | None = None
        self._port = 0
        self._instance = ""  # the current process's (engine_argv)
        self._restarts = 0
        self._crashes = 0  # consecutive crashes: the backoff exponent
        self._ready_at = 0.0
        self._spawned_at = 0.0
        self._probe_failures = 0
        self._kill_reason = ""  # why the owner killed the current process, if it did
        self._last_error = ""
        self._error = ""
        self._last_exit: int | None = None
        self._streak: tuple[str, int] = ("", 0)  # failed starts in a row with one error (failed_starts)
        self._helpers: set[asyncio.Task[None]] = set()  # probers and timers of the current process
        self._watcher: asyncio.Task[None] | None = None  # the exit watcher: outlives stop requests

    # -- what callers may do ----------------------------------------------------------------------
    def start(self) -> None:
        self._inbox.put_nowait(Start())

    async def stop(self, reason: str = "stop requested", timeout_s: float | None = None) -> EngineSnapshot:
        """Drain (SIGTERM, grace, SIGKILL) and wait until stopped; `run()` then returns."""
        self._inbox.put_nowait(Stop(reason))
        return await self.wait_for(State.STOPPED, timeout_s=timeout_s)

    async def wait_for(self, *states: State, timeout_s: float | None = None) -> EngineSnapshot:
        async with asyncio.timeout(timeout_s):
            while self._state not in states:
                await self._changed.wait()
        return self.snapshot()

    @property
    def state(self) -> State:
        return self._state

    @property
    def url(self) -> str | None:
        return f"http://{self.spec.host}:{self._port}" if self._port else None

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(
            self.spec.engine_id,
            self.spec.model_id,
            self.spec.n_slots,
            self._state,
            self._proc.pid if self._proc is not None else None,
            self.url,
            self._restarts,
            self._last_error,
            self._last_exit,
            self._instance if self._proc is not None else "",
            self._error,
            self.spec.role,
        )

    # -- the owner ---------------------------------------------------------------------------------
    async def run(self) -> None:
        """Handle messages until stopped by `stop()`. Cancelled, it kills the process on the way out."""
        own_http = self._http is None
        http = self._http or httpx.AsyncClient(timeout=self.policy.health_timeout_s)
        self._http = http
        try:
            while not (self._closing and self._state is State.STOPPED):
                await self._handle(await self._inbox.get())
        finally:
            self._cancel_helpers()
            if self._watcher is not None:
                self._watcher.cancel()
            proc = self._proc
            if proc is not None and proc.returncode is None:
                self._signal(signal.SIGKILL)
                with suppress(asyncio.TimeoutError, ProcessLookupError):
                    await asyncio.wait_for(asyncio.shield(proc.wait()), 5)
            if own_http:
                await http.aclose()

    async def _handle(self, msg: Message) -> None:
        state, current = self._state, getattr(msg, "run", self._run) == self._run
        match msg:
            case Start() if state in (State.STOPPED, State.CRASHED, State.FAILED) and not self._closing:
                if state is State.FAILED:  # asked again: as many tries as the first time
                    self._streak, self._crashes = ("", 0), 0
                await self._spawn("start requested" if state is State.STOPPED else "start requested again")
            case Notice(what="restart_due") if current and state is State.CRASHED and not self._closing:
                await self._spawn(f"restart {self._restarts + 1} after backoff")
            case Stop(reason=reason):
                self._closing = True
                if state in (State.CRASHED, State.FAILED):
                    self._cancel_helpers()
                    self._transition(State.STOPPED, reason)
                elif state in (State.STARTING, State.READY):
                    self._cancel_helpers()
                    self._transition(State.DRAINING, reason)
                    self._signal(signal.SIGTERM)
                    self._helper(self._after(self.policy.stop_grace_s, Notice(self._run, "grace_over")))
            case Notice(what="healthy") if current and state is State.STARTING:
                self._cancel_helpers()
                self._ready_at, self._streak = time.monotonic(), ("", 0)
                # What a person starting it wants to see on the console: how long the model took
                # to load, and which chat template and format the engine uses (from its own log).
                output = await asyncio.to_thread(read_tail, self.spec.log_path, 200, 1 << 16)
                load_s = round(self._ready_at - self._spawned_at, 2)
                facts = engine_facts(output)
                fallback = facts.pop("chat_template_fallback", "")
                self._transition(State.READY, "health check passed", load_s=load_s, **facts)
                if facts.get("chat_template") == FALLBACK_ORIGIN:
                    log.warning(
                        "engine.chat_template_fallback",
                        engine=self.spec.engine_id,
                        reason=f"{fallback or 'the model has no usable chat template'}: chats are "
                        "rendered as ChatML, which this model may not know",
                        hint="pass the model's template: --chat-template-file PATH (jinja), or "
                        "--chat-template NAME (chatml, llama3, gemma, ...); to a node as --engine-arg",
                    )
                self._helper(self._watch_health(self._run))
            case Notice(what="start_timeout") if current and state is State.STARTING:
                self._kill(f"not healthy within {self.policy.start_timeout_s:g} s")
            case Probe(ok=ok, error=error) if current and state is State.READY:
                self._probe_failures = 0 if ok else self._probe_failures + 1
                if self._probe_failures >= self.policy.health_failures:
                    self._kill(f"{self._probe_failures} health checks failed, last: {error}")
            case Notice(what="grace_over") if current and state is State.DRAINING:
                self._kill(f"still running {self.policy.stop_grace_s:g} s after SIGTERM")
            case Exited(returncode=rc) if current:
                await self._exited(rc)
            case _:  # about an earlier process, or moot in this state
                log.debug("engine.message_ignored", engine=self.spec.engine_id, message=repr(msg))

    async def _spawn(self, reason: str) -> None:
        self._cancel_helpers()
        if self._run > 0:
            self._restarts += 1
        self._run += 1
        self._kill_reason, self._probe_failures = "", 0
        self._port = self.spec.port or free_port(self.spec.host)
        self._instance = secrets.token_hex(8)
        argv = [str(a) for a in self._argv(self._port, self._instance)]
        self._transition(State.STARTING, reason, port=self._port)
        self._spawned_at = time.monotonic()
        if self._check_model is not None:
            problem = await asyncio.to_thread(self._check_model, self.spec.model)
            if problem is not None:
                self._crash(f"model {self.spec.model}: {problem}")
                return
        try:
            log_file = await asyncio.to_thread(self._open_log, argv)
            try:
                # start_new_session: its own process group, so that stop and kill reach its children
                self._proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=None if self.spec.env is None else dict(self.spec.env),
                )
            finally:
                log_file.close()
        except OSError as exc:
            self._crash(f"could not start {argv[0]}: {' '.join(str(exc).split())}")
            return
        log.info("engine.spawned", engine=self.spec.engine_id, pid=self._proc.pid)
        log.debug("engine.argv", engine=self.spec.engine_id, argv=argv)  # (long: in its log file too)
        self._watcher = asyncio.create_task(self._watch_exit(self._run, self._proc))
        self._helper(self._await_healthy(self._run))

    async def _exited(self, rc: int) -> None:
        self._cancel_helpers()
        self._signal(signal.SIGKILL)  # whatever the engine left in its group goes with it
        if self._state is State.DRAINING:
            self._proc, self._last_exit = None, rc
            how = self._kill_reason or f"exited with code {rc}"
            self._transition(State.STOPPED, how, returncode=rc)
            return
        reason = self._kill_reason or f"exited with code {rc} while {self._state}"
        tail = await asyncio.to_thread(read_tail, self.spec.log_path, self.policy.log_tail_lines)
        # The process goes with the state change, never before it: no snapshot is ready without a pid.
        self._proc, self._last_exit = None, rc
        # A process that failed to start said why (a ready one's last error may be about a request).
        said = engine_error(tail) if self._state is State.STARTING and not self._kill_reason else ""
        self._crash(f"{reason}: {said}" if said else reason, tail, rc)

    def _crash(self, error: str, output: str = "", rc: int | None = None) -> None:
        """Starting or ready → crashed, and a restart after the backoff; or starting → failed, for
        good, when this start failed like the `give_up_after - 1` before it. `error` is one line."""
        self._port = 0 if not self.spec.port else self._port
        error = " ".join(error.splitlines())
        self._error = error
        self._last_error = f"{error}\nlast output:\n{output}" if output else error
        p = self.policy
        if self._state is State.STARTING:
            self._streak = failed_starts(self._streak, error)
            if p.give_up_after and self._streak[1] >= p.give_up_after:
                self._ready_at = 0.0
                reason = f"gave up after {self._streak[1]} failed starts in a row: {error}"
                self._transition(State.FAILED, reason, returncode=rc, hint=self._give_up_hint())
                return
        if self._ready_at and time.monotonic() - self._ready_at >= p.stable_s:
            self._crashes = 0
        self._ready_at = 0.0
        self._crashes += 1
        delay = min(p.backoff_max_s, p.backoff_base_s * 2 ** min(self._crashes - 1, 32))
        self._transition(State.CRASHED, error, returncode=rc, retry_in_s=delay)
        self._helper(self._after(delay, Notice(self._run, "restart_due")))

    def _give_up_hint(self) -> str:
        """What a person can do about an engine that keeps failing to start the same way."""
        return (
            f"its output is in {self.spec.log_path}; `slotkeeper engine -m {self.spec.model}` runs it "
            "alone to show the cause (a model llama.cpp cannot load, an --engine-arg it refuses)"
        )

    def _kill(self, reason: str) -> None:
        """SIGKILL the group; the exit watcher's message completes the transition."""
        self._kill_reason = reason
        pid = self._proc.pid if self._proc is not None else None
        log.warning("engine.kill", engine=self.spec.engine_id, pid=pid, reason=reason)
        self._signal(signal.SIGKILL)

    def _transition(self, target: State, reason: str, **fields: Any) -> None:
        source = self._state
        if target not in TRANSITIONS[source]:
            raise AssertionError(f"engine {self.spec.engine_id}: no transition {source} -> {target}")
        self._state = target
        getattr(log, LEVELS[target])(
            "engine.transition",
            engine=self.spec.engine_id,
            reason=reason,
            pid=self._proc.pid if self._proc is not None else None,
            restarts=self._restarts,
            **{"from": str(source), "to": str(target)},
            **fields,
        )
        if self._on_transition is not None:
            self._on_transition(self.snapshot())
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # -- helpers: they only post messages ----------------------------------------------------------
    def _helper(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._helpers.add(task)
        task.add_done_callback(self._helpers.discard)

    def _cancel_helpers(self) -> None:
        current = asyncio.current_task()
        for task in list(self._helpers):
            if task is not current:
                task.cancel()
        self._helpers.clear()

    async def _after(self, delay: float, msg: Message) -> None:
        await asyncio.sleep(delay)
        self._inbox.put_nowait(msg)

    async def _watch_exit(self, run: int, proc: asyncio.subprocess.Process) -> None:
        self._inbox.put_nowait(Exited(run, await proc.wait()))

    async def _await_healthy(self, run: int) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.policy.start_timeout_s
        shown = 0  # the tenths of the weights already announced: a person at the console sees a load move
        while loop.time() < deadline:
            ok, _, progress = await self._probe()
            if ok:
                self._inbox.put_nowait(Notice(run, "healthy"))
                return
            if progress is not None and int(progress * 10) > shown:
                shown = int(progress * 10)
                log.info("engine.loading", engine=self.spec.engine_id, percent=shown * 10)
            await asyncio.sleep(self.policy.start_poll_s)
        self._inbox.put_nowait(Notice(run, "start_timeout"))

    async def _watch_health(self, run: int) -> None:
        while True:
            await asyncio.sleep(self.policy.health_interval_s)
            ok, error, _ = await self._probe()
            self._inbox.put_nowait(Probe(run, ok, error))

    async def _probe(self) -> tuple[bool, str, float | None]:
        """Healthy or not, why not, and how far a loading engine's weights are (None: not said)."""
        assert self._http is not None
        url = f"{self.url}/health"
        try:
            r = await self._http.get(url, timeout=self.policy.health_timeout_s)
        except Exception as exc:  # noqa: BLE001 — a probe that fails in any way is an unhealthy answer
            # (httpcore can fail outside its errors when the socket closes as it connects: an
            # AttributeError from anyio's peer name. The probe loop must live on: it alone notices a
            # start that never ends, and a healthy engine that stops answering.)
            return False, f"GET {url}: {type(exc).__name__}: {exc}", None
        return r.status_code == 200, f"GET {url}: HTTP {r.status_code}", load_progress(r)

    def _open_log(self, argv: list[str]) -> Any:  # handed to the child, closed by _spawn
        self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.spec.log_path, "ab")
        f.write(f"--- slotkeeper: run {self._run}: {' '.join(argv)}\n".encode())
        f.flush()
        return f

    def _signal(self, sig: int) -> None:
        if self._proc is None:
            return
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)  # the group id is the pid: start_new_session=True

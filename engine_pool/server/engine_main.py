"""`slotkeeper engine`: one process, one model, N slots — settings, logging, uvicorn (one worker).

Startup reads top to bottom: settings from flags and environment, logging, the runtime, the app,
then uvicorn serves until SIGTERM/SIGINT (uvicorn turns them into a graceful shutdown: stop
accepting, finish responses, then the lifespan closes the native engine). Exit codes: 0 after a
clean shutdown, 1 when the model failed to load or the chat template that the flags ask for
cannot be used (runtime.py), 2 for bad flags or variables.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from types import FrameType

import structlog
import uvicorn

from .. import logs
from ..signals import SignalServer
from .app import build_app
from .runtime import Runtime
from .settings import SettingsError, build_parser, describe, parse_settings


class _Server(SignalServer):
    def __init__(self, config: uvicorn.Config, runtime: Runtime) -> None:
        super().__init__(config)
        self.runtime = runtime

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Stop admitting at once; uvicorn then waits for the responses in flight, which the
        # runtime aborts (with an error event or response) when the grace period is over.
        self.runtime.request_drain()
        super().handle_exit(sig, frame)


def _exit_with_parent() -> None:
    """Ask the kernel for SIGTERM when our parent dies: an engine started by a node agent that was
    SIGKILLed must not live on holding a port and gigabytes of memory (it runs in a session of its
    own, so killing the agent's process group does not reach it)."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the supervisor's own stop still applies
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        build_parser().print_help()
        return 0
    try:
        settings = parse_settings(argv, os.environ)
    except SettingsError as exc:
        print(f"slotkeeper engine: error: {exc}\n(see `slotkeeper engine --help`)", file=sys.stderr)
        return 2
    if settings.exit_with_parent:
        _exit_with_parent()
    logs.configure(settings.log_format, settings.log_level)
    log = structlog.get_logger("engine")
    log.info("engine.starting", settings=describe(settings))

    runtime = Runtime(settings)
    server: _Server | None = None

    def on_fatal() -> None:
        if server is not None:
            server.should_exit = True

    config = uvicorn.Config(
        build_app(runtime, on_fatal),
        host=settings.host,
        port=settings.port,
        workers=1,  # one native engine per process: its event queue has a single consumer
        lifespan="on",
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 5,
    )
    server = _Server(config, runtime)
    server.run()
    if runtime.state == "failed":
        log.error("engine.exit", code=1, reason=runtime.error)
        return 1
    log.info("engine.exit", code=0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

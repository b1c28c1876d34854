"""Fatal start-up errors: what is wrong in one line, what to do in a second, and the exit status.

Every server command (`serve`, `node`, `gateway`) ends a start that cannot go on the same way: the
code that finds the problem raises `StartError(message, hint, code)`, and the command's `main`
hands it to `report` — the one place that words it: two lines on a terminal
(``slotkeeper serve: error: ...`` and ``  hint: ...``), one JSON event at level error otherwise,
never a traceback. The exit statuses (docs/operations.md, "Exit status"):

    0  stopped as asked (SIGTERM/Ctrl-C), every live session stored
    1  ran, then failed: a drain that could not store every session; `serve` whose engines all
       gave up (`--keep-running` keeps it up instead)
    2  refused before anything started: a flag, a SLOTKEEPER_* variable, the tenants file or a model
    3  could not start: a port in use, the data directory not writable, the index or the store
       unreachable (uvicorn's own status for a failed start, too)
"""

from __future__ import annotations

import errno
import socket
import sys
from dataclasses import dataclass

import structlog

from .logs import resolve_format

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3

log = structlog.get_logger("slotkeeper.start")


@dataclass(frozen=True)
class StartError(Exception):
    """A start that cannot go on: `message` says what is wrong, `hint` what to do about it."""

    message: str
    hint: str
    code: int = EXIT_UNAVAILABLE

    def __str__(self) -> str:
        return self.message


def report(command: str, err: StartError, log_format: str = "auto") -> int:
    """Say `err` once, as the console or a log collector reads it; return its exit status."""
    if resolve_format(log_format) == "console":
        print(f"slotkeeper {command}: error: {err.message}\n  hint: {err.hint}", file=sys.stderr, flush=True)
    else:
        log.error(f"{command}.start_failed", error=err.message, hint=err.hint, exit_code=err.code)
    return err.code


def listen_socket(host: str, port: int, flag: str) -> socket.socket:
    """A socket bound to `host`:`port` for a server to accept on (uvicorn's `sockets=`), bound before
    anything else starts, so that a port in use ends the start at once, naming `flag`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn: TIME_WAIT is no owner)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise StartError(
                f"port {port} on {host} is in use",
                f"pass {flag} with a free port, or stop the process listening on {port}",
            ) from None
        raise StartError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}",
            f"pass another {flag}"
            if exc.errno != errno.EADDRNOTAVAIL
            else "pass --host with an address of this machine",
        ) from None
    sock.set_inheritable(True)
    return sock

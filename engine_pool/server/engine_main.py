"""`slotkeeper engine`: one process, one model, N slots — settings, logging, uvicorn (one worker).

Startup reads top to bottom: settings from flags and environment, logging, the listening sockets
(one per `--host` address, as llama-server: TCP addresses share `--port`, a path ending in `.sock`
is a UNIX socket), the runtime, the app, then uvicorn serves on those sockets until SIGTERM/SIGINT
(uvicorn turns them into a graceful shutdown: stop accepting, finish responses, then the lifespan
closes the native engine). Exit codes: 0 after a clean shutdown, 1 when an address cannot be bound,
the model failed to load or the chat template that the flags ask for cannot be used (runtime.py),
2 for bad flags or variables.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import stat
import sys
from collections.abc import Sequence
from types import FrameType

import structlog
import uvicorn

from engine_pool.http import keep_alive
from engine_pool.process import logs
from engine_pool.process.flags import settings_or_status
from engine_pool.process.signals import SignalServer

from .app import build_app
from .header_case import CanonicalHeaderProtocol
from .runtime import Runtime
from .settings import build_parser, describe, parse_settings


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


def bind_sockets(hosts: Sequence[str], port: int) -> list[socket.socket]:
    """One bound socket per address: TCP ones on `port` (0: any free port, one TCP address only),
    UNIX ones at the path (a stale socket file left by a killed engine is replaced). With several TCP
    addresses an IPv6 one binds IPv6 only, so `0.0.0.0,::` does not collide (llama-server's rule).
    Raises OSError naming the address that failed; what was bound by then is closed."""
    tcp = [h for h in hosts if not h.endswith(".sock")]
    out: list[socket.socket] = []
    try:
        for host in [*tcp, *(h for h in hosts if h.endswith(".sock"))]:  # TCP first: uvicorn logs [0]
            if host.endswith(".sock"):
                with contextlib.suppress(FileNotFoundError):
                    if stat.S_ISSOCK(os.stat(host).st_mode):
                        os.unlink(host)
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                out.append(sock)
                sock.bind(host)
                os.chmod(host, 0o666)  # as uvicorn's --uds: access is the API key's business
                continue
            family, kind, proto, _, addr = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            sock = socket.socket(family, kind, proto)
            out.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and len(tcp) > 1:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
    except OSError as exc:
        for sock in out:
            sock.close()
        raise OSError(exc.errno, f"cannot listen on {host} (port {port}): {exc.strerror or exc}") from exc
    return out


def _unlink_sockets(hosts: Sequence[str]) -> None:
    for host in hosts:
        if host.endswith(".sock"):
            with contextlib.suppress(OSError):
                os.unlink(host)


def main(argv: list[str]) -> int:
    settings = settings_or_status("engine", argv, lambda: parse_settings(argv, os.environ), build_parser)
    if isinstance(settings, int):
        return settings
    if settings.exit_with_parent:
        _exit_with_parent()
    logs.configure(settings.log_format, settings.effective_log_level)
    log = structlog.get_logger("engine")
    log.info("engine.starting", settings=describe(settings))
    try:
        sockets = bind_sockets(settings.hosts, settings.port)
    except OSError as exc:
        log.error("engine.exit", code=1, reason=str(exc))
        return 1
    log.info("engine.listening", addresses=[_address(s) for s in sockets])

    runtime = Runtime(settings)
    server: _Server | None = None

    def on_fatal() -> None:
        if server is not None:
            server.should_exit = True

    config = uvicorn.Config(
        build_app(runtime, on_fatal),
        # For uvicorn's own start message only: it serves `sockets`.
        host=settings.tcp_hosts[0] if settings.tcp_hosts else "127.0.0.1",
        port=settings.port,
        uds=None if settings.tcp_hosts else settings.hosts[0],
        workers=1,  # one native engine per process: its event queue has a single consumer
        http=CanonicalHeaderProtocol,  # header names in llama-server's case (header_case.py)
        lifespan="on",
        log_config=None,
        access_log=False,
        timeout_keep_alive=round(keep_alive.SERVER_S),
        timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 5,
    )
    server = _Server(config, runtime)
    try:
        server.run(sockets=sockets)
    finally:
        for sock in sockets:
            sock.close()
        _unlink_sockets(settings.hosts)
    if runtime.state == "failed":
        log.error("engine.exit", code=1, reason=runtime.error)
        return 1
    log.info("engine.exit", code=0)
    return 0


def _address(sock: socket.socket) -> str:
    name = sock.getsockname()
    if sock.family == socket.AF_UNIX:
        return f"unix://{name}"
    host = f"[{name[0]}]" if sock.family == socket.AF_INET6 else name[0]
    return f"http://{host}:{name[1]}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

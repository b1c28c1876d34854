"""A uvicorn server that keeps SIGTERM/SIGINT for itself.

uvicorn re-raises the signal once its graceful shutdown is done, so the process would die by the
signal; our processes exit with their own status instead (a supervisor tells a graceful stop from a
crash or a SIGKILL by it). Subclasses decide what a signal means in `handle_exit` (drain first,
stop admitting, ...).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

import uvicorn


class SignalServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

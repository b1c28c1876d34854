"""structlog for an engine process: JSON lines (or console text) on stderr, stdlib loggers included.

Configured once by the process entry point; request-scoped values (request id, path) are bound in
contextvars by the app's edge middleware and appear on every event of that request.
"""

from __future__ import annotations

import logging
import sys

import structlog

# Loggers whose INFO lines are per-call chatter our own events already cover (httpx logs every request,
# health polls included).
_QUIET = ("httpx", "httpcore")


def resolve_format(fmt: str) -> str:
    """`auto` is console text for a person at a terminal (stderr is a TTY), JSON lines otherwise."""
    if fmt != "auto":
        return fmt
    try:
        return "console" if sys.stderr.isatty() else "json"
    except ValueError:  # a closed stream
        return "json"


class _Once(logging.Filter):
    """Each INFO message of uvicorn's server lifecycle once per process: `serve` runs two servers
    (gateway and node) whose start-up and shutdown lines are word for word the same."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO:
            return True
        text = record.getMessage()
        if text in self._seen:
            return False
        self._seen.add(text)
        return True


class _OneLine(logging.Filter):
    """A failed start-up says why in one line: uvicorn logs a lifespan that raised with its whole
    traceback (Starlette's startup-failure message is the formatted traceback). Above debug level
    only the exception's own last line stays; --log-level debug keeps the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            record.msg, record.args = f"{record.getMessage().strip()}: {type(exc).__name__}: {exc}", ()
            record.exc_info, record.exc_text = None, None
        text = record.getMessage()
        if text.startswith("Traceback (most recent call last)"):
            last = [line for line in text.splitlines() if line.strip()][-1]
            record.msg, record.args = f"start-up failed: {last.strip()}", ()
        return True


def configure(fmt: str = "auto", level: str = "info") -> None:
    """`fmt`: json, console or auto (`resolve_format`)."""
    fmt = resolve_format(fmt)
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    # uvicorn and other stdlib loggers through the same renderer.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(processor=renderer, foreign_pre_chain=shared))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    for name in _QUIET:
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
    lifecycle = logging.getLogger("uvicorn.error")
    lifecycle.filters = [f for f in lifecycle.filters if not isinstance(f, _Once | _OneLine)] + [_Once()]
    if lifecycle.getEffectiveLevel() > logging.DEBUG:
        lifecycle.addFilter(_OneLine())

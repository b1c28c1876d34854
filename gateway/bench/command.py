"""`slotkeeper bench NAME [ARGS]`: run gateway.bench.NAME's main(argv).

Benchmarks are imported only when one runs: each pulls in the `bench` extra's tools (and some the
test suite's), which a plain install does not have, and listing them must work without any.
"""

from __future__ import annotations

import importlib
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

# name on the command line → what it measures; the module is gateway.bench.<name with _ for ->.
BENCHMARKS: dict[str, str] = {
    "disagg": "decoding sessions while long prompts arrive: unsplit, split with logits, last-token",
    "fuzz": "malformed and valid bodies for N minutes; no answer may be a 5xx",
    "gateway": "what the gateway costs: overhead, routing decision, restore",
    "prefix": "new sessions sharing a system prompt, side by side with llama-server",
    "resume": "a long session's next turn, live and after save/restart/restore",
    "routing": "the gateway's routing decision in process, no servers",
    "sessions": "agent sessions taking turns on fewer slots, side by side with llama-server",
    "soak": "load, a hostile client and engine crashes at once",
    "storage": "storage/ against raw transfers and a full save per turn",
    "throughput": "prefill and decode tokens/s with busy slots, side by side",
    "upstream-suite": "llama-server's own test suite against `slotkeeper engine`",
}


def _usage() -> str:
    width = max(len(n) for n in BENCHMARKS)
    lines = ["usage: slotkeeper bench NAME [ARGS...]", "", "benchmarks:"]
    lines += [f"  {name.ljust(width)}  {summary}" for name, summary in BENCHMARKS.items()]
    lines += ["", "`slotkeeper bench NAME --help` describes a benchmark's flags."]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name = argv[0].replace("_", "-")  # `upstream_suite`, the module's own spelling, works too
    if name not in BENCHMARKS:
        print(f"slotkeeper bench: no benchmark {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(f"gateway.bench.{name.replace('-', '_')}")
    except ImportError as exc:  # a tool of the bench extra (or of the test extra) is missing
        print(f"slotkeeper bench {name}: {exc}; install slotkeeper[bench]", file=sys.stderr)
        return 2
    entry: Callable[[list[str]], int | None] = module.main
    if threading.current_thread() is not threading.main_thread():  # (no signals there)
        return int(entry(argv[1:]) or 0)
    previous = signal.signal(signal.SIGTERM, _interrupted)
    try:
        return int(entry(argv[1:]) or 0)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupted(signum: int, frame: Any) -> None:
    """SIGTERM cleans up like Ctrl-C: a bench's servers (Redis, S3, engines, llama-server) stop on
    the way out instead of outliving it."""
    raise KeyboardInterrupt

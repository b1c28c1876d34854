"""The `slotkeeper` command: one table of subcommands, each implemented by the package it belongs to.

Every entry is `name: (module, function, summary)`; the function takes the remaining argv and
returns the exit code. Modules are imported only when their command runs, so `slotkeeper inspect`
never loads libllama.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

COMMANDS: dict[str, tuple[str, str, str]] = {
    "engine": (
        "engine_pool.server.engine_main",
        "main",
        "one engine process: llama-server-compatible API over the native core",
    ),
    "serve": ("gateway.serve", "main", "all-in-one: gateway + node agent + engines on this machine"),
    "node": (
        "engine_pool.pool.main",
        "main",
        "node agent: engine pool, spill/fill of slot files, drain on SIGTERM",
    ),
    "gateway": (
        "gateway.main",
        "main",
        "stateless multi-tenant OpenAI-compatible gateway (needs --node URLs)",
    ),
    "make-model": ("native.model_gen", "main", "write a tiny (or bench) random-weight GGUF test model"),
    "sessions": (
        "gateway.sessions_command",
        "main",
        "list, show and delete sessions (a gateway or a data dir)",
    ),
    "inspect": (
        "storage.slotfile.inspect",
        "main",
        "print a slot file's or a stored manifest's contents and verdict",
    ),
    "reindex": ("storage.index.reindex", "main", "rebuild the Redis session index from storage"),
    "bench": ("gateway.bench.command", "main", "run a benchmark (resume, storage, gateway, ...)"),
}


def _usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: slotkeeper COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {summary}" for name, (_, _, summary) in COMMANDS.items()]
    lines += ["", "`slotkeeper COMMAND --help` describes a command's flags."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"slotkeeper: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    # Logs go to stderr (stdout stays for a command's own output, e.g. `inspect --json`), console text
    # on a terminal; the server commands reconfigure with their --log-level / --log-format.
    from engine_pool.process import logs

    logs.configure("auto", "info")
    module, func, _ = COMMANDS[name]
    entry: Callable[[list[str]], int] = getattr(importlib.import_module(module), func)
    return int(entry(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())

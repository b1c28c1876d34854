"""The real agent CLIs, installed from the npm registry at pinned versions once per machine, and run
in a home of their own so that nothing of the machine's (keys, configs, sessions) leaks in.

`installed(cli)` returns the CLI's executable in the test cache directory (`~/.cache/slotkeeper/`,
or `$SLOTKEEPER_TEST_CACHE`, as for the Gemma model): `npm install --prefix` into a temporary
directory there, then renamed into place — a directory under the final name is always a complete
install, even when two runs install at the same time or one is killed halfway.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from gateway.bench.harness.gemma import cache_dir
from support.recording_proxy import Exchange


@dataclass(frozen=True)
class Cli:
    package: str
    version: str
    command: str  # its executable's name in node_modules/.bin


CLAUDE = Cli("@anthropic-ai/claude-code", "2.1.197", "claude")
CODEX = Cli("@openai/codex", "0.171.0", "codex")
OPENCODE = Cli("opencode-ai", "1.18.33", "opencode")

INSTALL_TIMEOUT_S = 900  # three ~250-450 MB packages on a slow link


def _npm() -> str:
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        pytest.fail("node and npm are needed to install the agent CLIs (.ci/run installs them with apt)")
    return npm


def installed(cli: Cli, root: Path | None = None) -> Path:
    """The executable of `cli` at its pinned version, installed on first use."""
    base = (root or cache_dir()) / "agent-clis"
    target = base / f"{cli.package.replace('/', '+')}@{cli.version}"
    executable = target / "node_modules" / ".bin" / cli.command
    if executable.exists():
        return executable  # only a finished install is ever renamed to this name
    base.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=base))
    try:
        proc = subprocess.run(
            [_npm(), "install", "--prefix", str(staging), "--no-audit", "--no-fund", "--loglevel=error"]
            + [f"{cli.package}@{cli.version}"],
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
            env={**os.environ, "npm_config_update_notifier": "false"},
        )
        assert proc.returncode == 0, f"npm install {cli.package}@{cli.version}:\n{proc.stdout}{proc.stderr}"
        try:
            staging.rename(target)
        except OSError:  # another run finished first: its install is as good
            if not executable.exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return executable


def isolated_env(home: Path, **extra: str) -> dict[str, str]:
    """An environment for a CLI run: the machine's PATH (node, git) and locale, a home of its own
    with every XDG directory inside it, and `extra`; nothing else of the test process's."""
    dirs = {
        "XDG_CONFIG_HOME": home / ".config",
        "XDG_DATA_HOME": home / ".local" / "share",
        "XDG_STATE_HOME": home / ".local" / "state",
        "XDG_CACHE_HOME": home / ".cache",
    }
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    return {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "HOME": str(home),
        "TERM": "dumb",
        "NO_COLOR": "1",
        **{k: str(v) for k, v in dirs.items()},
        **extra,
    }


def run(
    argv: Sequence[str],
    cwd: Path,
    env: dict[str, str],
    *,
    served: Callable[[subprocess.CompletedProcess[str]], bool] = lambda p: p.returncode == 0,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """Runs one CLI invocation to its end; a run that `served` does not accept (by default: a
    non-zero exit) fails the test with the exit status and both streams."""
    proc = subprocess.run(
        list(argv),
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert served(proc), f"{argv[1:]} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@dataclass
class Ledger:
    """The main calls of a test's CLI runs, by scenario, and the reuse rules they must meet: every
    main call answered 200 with its usage; a call that continues a conversation read at least
    `continued` of the previous call's prompt from cache; a new session's first call at least
    `new_session` of its own prompt."""

    is_main: Callable[[Exchange], bool]
    continued: float = 0.95
    new_session: float = 0.90

    def __post_init__(self) -> None:
        self.rows: list[tuple[str, Exchange]] = []

    def add(self, scenario: str, exchanges: Sequence[Exchange]) -> list[Exchange]:
        """Records `exchanges`' main calls under `scenario` and returns them (at least one)."""
        calls = [e for e in exchanges if self.is_main(e)]
        self.rows += [(scenario, c) for c in calls]
        assert calls, f"{scenario}: no main call among {[(e.method, e.path, e.status) for e in exchanges]}"
        for c in calls:
            assert c.status == 200 and c.broken is None and c.prompt is not None, (
                f"{scenario}: call {c.seq} answered {c.status} {c.broken or ''}: {c.answer[:500]}\n{self}"
            )
        return calls

    def check(self, calls: Sequence[Exchange], after: Exchange | None) -> None:
        """`calls` (one run's main calls, in order) continue `after`, or start a new session (None)."""
        first = calls[0]
        if after is None:
            assert (first.cached or 0) >= self.new_session * (first.prompt or 0), f"new session:\n{self}"
        else:
            assert _continues(after, first, self.continued), f"call {first.seq} after {after.seq}:\n{self}"
        for prev, call in zip(calls, calls[1:], strict=False):
            assert _continues(prev, call, self.continued), f"call {call.seq} after {prev.seq}:\n{self}"

    def __str__(self) -> str:
        lines = [f"{'scenario':<28} {'call':>4} {'prompt':>7} {'cached':>7} {'reuse':>6}  served"]
        for scenario, c in self.rows:
            served = c.answer_headers.get("x-slotkeeper-cache", "-")
            lines.append(f"{scenario:<28} {c.seq:>4} {c.prompt:>7} {c.cached:>7} {c.reuse:>6.1%}  {served}")
        return "\n".join(lines)


def _continues(earlier: Exchange, later: Exchange, share: float) -> bool:
    return (later.cached or 0) >= share * (earlier.prompt or 0)

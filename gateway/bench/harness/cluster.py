"""A gateway and several node agents as processes on this machine, sharing a redis-server and an
S3 server (moto's), for benchmarks that need more than one node (`slotkeeper serve` runs one): each
node with its own flags, every process with the bench's internal key; ready when the gateway
answers /ready and every node's engines are ready. Its engines (every node's, in node order), the
gateway's log events, and a stop that kills everything (each engine's process group too)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx

from engine_pool.protocol.node import NodeEngine
from gateway.bench.harness.answers import engine_list
from gateway.bench.harness.serve import INTERNAL_AUTH, INTERNAL_KEY, log_events
from gateway.bench.harness.servers import (
    AWS_ENV,
    PACKAGE_ROOT,
    MotoProcess,
    free_port,
    kill_engines,
    make_bucket,
    redis_server,
    stop,
    wait_until,
)

T = TypeVar("T")


@dataclass
class Cluster:
    url: str
    node_urls: list[str]
    procs: list[subprocess.Popen[bytes]]
    log: Path  # the gateway's
    logs: list[Path]  # every process's, the gateway's last
    engine_pids: set[int] = field(default_factory=set)

    def engines(self) -> list[NodeEngine]:
        return [
            e
            for url in self.node_urls
            for e in engine_list(httpx.get(url + "/v1/engines", headers=INTERNAL_AUTH, timeout=5))
        ]

    def events(self, name: str, payload: type[T]) -> list[T]:
        """The gateway log's JSON events called `name` (see `Serve.events`)."""
        return log_events(self.log, name, payload)

    def kill(self) -> None:
        try:
            self.engine_pids |= {e.pid for e in self.engines() if e.pid}
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        for proc in self.procs:
            stop(proc, signal.SIGKILL)
        kill_engines(self.engine_pids)

    def tail(self) -> str:
        return "\n".join(f"== {log.name}\n{log.read_text(errors='replace')[-1500:]}" for log in self.logs)


def _launch(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", *argv],
            cwd=PACKAGE_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )


def _answers(url: str, path: str) -> bool:
    try:
        return httpx.get(url + path, timeout=2, headers=INTERNAL_AUTH).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def clustered(
    workdir: Path,
    name: str,
    nodes: Sequence[Sequence[str]],
    gateway: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Iterator[Cluster]:
    """Node agents n1, n2, ... (``nodes``: each one's flags) and a gateway (``gateway``: its flags)
    over one redis-server, in ``workdir``/``name``."""
    base = workdir / name
    (base / "redis").mkdir(parents=True, exist_ok=True)
    env = {**(os.environ if env is None else env), **AWS_ENV, "SLOTKEEPER_INTERNAL_KEY": INTERNAL_KEY}
    with ExitStack() as stack:
        redis = f"redis://127.0.0.1:{stack.enter_context(redis_server(base / 'redis'))}"
        s3 = MotoProcess(base)
        s3.start()
        stack.callback(s3.kill)
        make_bucket(s3.endpoint, "slots")
        common = [
            *("--redis-url", redis, "--redis-prefix", name),
            *("--s3-endpoint", s3.endpoint, "--s3-bucket", "slots", "--s3-prefix", name),
        ]
        procs: list[subprocess.Popen[bytes]] = []
        logs: list[Path] = []
        urls: list[str] = []
        for i, flags in enumerate(nodes, 1):
            port = free_port()
            log = base / f"n{i}.log"
            argv = ["node", "--node-id", f"n{i}", "--port", str(port), "--data-dir", str(base / f"n{i}")]
            procs.append(_launch([*argv, *common, *flags], log, env))
            logs.append(log)
            urls.append(f"http://127.0.0.1:{port}")
        port = free_port()
        log = base / "gateway.log"
        argv = ["gateway", "--port", str(port), "--data-dir", str(base / "gateway")]
        argv += [a for url in urls for a in ("--node", url)]
        procs.append(_launch([*argv, *common, *gateway], log, env))
        logs.append(log)
        cluster = Cluster(f"http://127.0.0.1:{port}", urls, procs, log, logs)
        stack.callback(cluster.kill)
        try:
            for url, proc in zip(urls, procs, strict=False):
                wait_until(lambda u=url: _answers(u, "/health"), proc, f"node {url}", timeout=60)
            wait_until(lambda: _answers(cluster.url, "/ready"), procs[-1], "the gateway", timeout=60)
            wait_until(
                lambda: all(e.state == "ready" for e in cluster.engines()),
                procs[-1],
                "the engines",
                timeout=180,
            )
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n{cluster.tail()}") from None
        yield cluster

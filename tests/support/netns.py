"""A small network of test hosts on this machine: one network namespace per host, each wired by a
veth pair to a bridge in the test's own namespace, so that a host can be cut off (its link down) and
put back while its processes keep running, exactly as a partition does to them.

This kernel has no ``sch_netem`` (``tc qdisc add ... netem`` answers "Specified qdisc kind is
unknown"), so a slow, lossy link is a `SlowLink`: a relay in front of a host's port that holds every
chunk for the link's delay each way and, for the loss rate's share of the chunks, for a TCP
retransmission timeout more — what a lost segment costs a TCP stream.

Needs root (``ip netns``); `available` says whether this machine lets us.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

RTO_S = 0.2  # Linux's minimum TCP retransmission timeout: what one lost segment stalls a stream


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *(("-n", netns) if netns else ()), *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=10)


def available() -> str | None:
    """None when network namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is missing"
    name = "skprobe" + secrets.token_hex(3)
    try:
        _ip("netns", "add", name)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"ip netns add failed: {exc}"
    _ip("netns", "del", name)
    return None


@dataclass
class Host:
    """A network namespace with one address on the lab's bridge."""

    name: str
    netns: str
    address: str
    link: str  # the veth end on the bridge: down cuts the host off
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def popen(
        self, argv: Sequence[str], log: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside this host (its own process group), output to ``log``."""
        with log.open("ab") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.netns, *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )
        self.procs.append(proc)
        return proc


class Lab:
    """Hosts on one bridge, 10.X.0.0/24 with the test's own namespace at .1 (it reaches every host)."""

    def __init__(self) -> None:
        tag = secrets.token_hex(2)
        self.tag = tag
        self.bridge = f"skbr{tag}"
        self.subnet = f"10.{random.randint(64, 250)}.{random.randint(0, 250)}"
        self.hosts: dict[str, Host] = {}
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def host(self, name: str) -> Host:
        n = len(self.hosts) + 2
        netns, outer, inner = f"sk{self.tag}{name}", f"sk{self.tag}h{n}", "eth0"
        _ip("netns", "add", netns)
        _ip("link", "add", outer, "type", "veth", "peer", "name", f"sk{self.tag}p{n}")
        _ip("link", "set", f"sk{self.tag}p{n}", "netns", netns)
        _ip("link", "set", f"sk{self.tag}p{n}", "name", inner, netns=netns)
        _ip("addr", "add", f"{self.subnet}.{n}/24", "dev", inner, netns=netns)
        _ip("link", "set", inner, "up", netns=netns)
        _ip("link", "set", "lo", "up", netns=netns)
        _ip("link", "set", outer, "master", self.bridge)
        _ip("link", "set", outer, "up")
        host = Host(name, netns, f"{self.subnet}.{n}", outer)
        self.hosts[name] = host
        return host

    def cut(self, name: str) -> None:
        """Partition the host from every other (its processes run on)."""
        _ip("link", "set", self.hosts[name].link, "down")

    def mend(self, name: str) -> None:
        _ip("link", "set", self.hosts[name].link, "up")

    def close(self) -> None:
        for host in self.hosts.values():
            for proc in host.procs:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(10)
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("link", "del", host.link)
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "del", host.netns)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", self.bridge)


@contextlib.contextmanager
def lab() -> Iterator[Lab]:
    net = Lab()
    try:
        yield net
    finally:
        net.close()


class SlowLink:
    """A TCP relay with a link's delay and loss (see the module doc), run on a thread of the test.

    It listens on ``listen`` (host, port) and forwards to ``target``; set ``delay_s``/``loss`` at any
    time (0/0: a plain relay)."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], *, seed: int = 0) -> None:
        self.listen, self.target = listen, target
        self.delay_s, self.loss = 0.0, 0.0
        self.stalls = 0  # chunks held for a retransmission timeout
        self._random = random.Random(seed)
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("the relay did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, *self.listen))
        self._started.set()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer), return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Each chunk is delivered ``delay_s`` after it arrived (a stalled one ``RTO_S`` later), in
        order: latency, not a cap on throughput."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    return
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(deliver())
        try:
            while data := await reader.read(65536):
                due = loop.time() + self.delay_s
                if self.loss and self._random.random() < self.loss:
                    due += RTO_S
                    self.stalls += 1
                queue.put_nowait((due, data))
            queue.put_nowait((0.0, b""))
            await sender
        finally:
            sender.cancel()
            with contextlib.suppress(Exception):
                writer.close()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

"""A small network of test hosts on this machine: one network namespace per host, each wired by a
veth pair to a bridge in the test's own namespace, so that a host can be cut off (its link down) and
put back while its processes keep running, exactly as a partition does to them. (A slow or lossy
link is `gateway.bench.harness.slow_link`: this kernel has no ``sch_netem``.)

Needs root (``ip netns``); `available` says whether this machine lets us.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path


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
        self.address = f"{self.subnet}.1"  # the test's own namespace on the bridge
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

    def keep_apart(self, name: str, other: str) -> None:
        """``name`` can no longer reach ``other`` (its connections fail at once: no route), while
        both still reach every other host and are reached by them."""
        _ip("route", "add", "unreachable", f"{self.hosts[other].address}/32", netns=self.hosts[name].netns)

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

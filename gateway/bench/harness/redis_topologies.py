"""Redis Cluster and Sentinel set-ups of real redis-servers on free loopback ports, for tests and
`slotkeeper bench routing`: a cluster of three primaries with a replica each (``redis-cli --cluster
create``), and a master with a replica watched by three sentinels; of redis-servers or of
valkey-servers (``server="valkey"``). Each yields the ``--redis-url``
that names it (storage.index.topology), and can kill a primary to see its replica promoted.

Both keep nothing on disk, as the chart's in-cluster default. Cluster nodes run with
``cluster-require-full-coverage no``: a shard without a primary refuses its own slots only, which is
what the docs ask of a production cluster too.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gateway.bench.harness.servers import RedisProcess, free_port, stop

NODE_TIMEOUT_MS = 1500  # how long a silent primary stays one (cluster-node-timeout, down-after)


class _Node(RedisProcess):
    """A server with extra configuration lines (cluster mode, or a replica of another)."""

    def __init__(self, data: Path, extra: list[str], server: str, *, bus: bool = False) -> None:
        """``bus``: a cluster node, whose bus port (its port + 10000) must be free too."""
        data.mkdir(parents=True, exist_ok=True)
        super().__init__(data, port=free_port(also_plus=10000) if bus else None, server=server)
        self.extra = extra

    def argv(self) -> list[str]:
        return [*super().argv(), *("--repl-diskless-sync-delay", "0"), *self.extra]

    def info(self, section: str) -> str:
        return cli(self.port, "info", section)


def cli(port: int, *words: str, timeout: float = 30.0) -> str:
    """``redis-cli -p port words...``: its output."""
    out = subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", str(port), *words],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return out.stdout


_REHASHING = re.compile(r"rehashing target|rehashing index: [0-9]")


def rehashing(port: int) -> bool:
    """Whether the server on ``port`` is growing its key table (DEBUG HTSTATS: redis-server names
    a rehashing target, valkey-server a rehashing index). Until it is done, each key looked up also
    moves a bucket of the old table into the new one: a table just grown past a power of two makes
    every command slower for a while, whatever the number of keys."""
    return bool(_REHASHING.search(cli(port, "debug", "htstats", "0")))


def _wait(what: str, check: object, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise TimeoutError(f"{what}: not within {timeout_s} s")


class ClusterProcesses:
    """``primaries`` primaries with ``replicas`` replicas each, every slot assigned."""

    def __init__(self, data: Path, primaries: int = 3, replicas: int = 1, server: str = "redis") -> None:
        self.nodes = [
            _Node(
                data / f"node{i}",
                [
                    *("--cluster-enabled", "yes"),
                    *("--cluster-config-file", "nodes.conf"),
                    *("--cluster-node-timeout", str(NODE_TIMEOUT_MS)),
                    *("--cluster-require-full-coverage", "no"),
                    *("--cluster-allow-replica-migration", "no"),
                ],
                server,
                bus=True,
            )
            for i in range(primaries * (1 + replicas))
        ]
        self.primaries, self.replicas = primaries, replicas

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[: self.primaries])

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        hosts = [f"127.0.0.1:{n.port}" for n in self.nodes]
        words = ["--cluster", "create", *hosts, "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        subprocess.run(["redis-cli", *words], capture_output=True, check=True, timeout=60)
        self.wait_ok()
        _wait("the replicas in sync", self._replicas_synced)

    def _replicas_synced(self) -> bool:
        infos = [n.info("replication") for n in self.alive()]
        return (
            all("master_link_status:up" in i for i in infos if "role:slave" in i)
            and sum("role:slave" in i for i in infos) == self.primaries * self.replicas
        )

    def alive(self) -> list[_Node]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def primary_ports(self) -> list[int]:
        """The ports of the nodes that are primaries now (as a live node's CLUSTER NODES says)."""
        for node in self.alive():
            lines = cli(node.port, "cluster", "nodes").splitlines()
            if lines:
                return sorted(
                    int(parts[1].split("@")[0].rsplit(":", 1)[1])
                    for parts in (line.split() for line in lines)
                    if "master" in parts[2] and "fail" not in parts[2]
                )
        return []

    def wait_ok(self, timeout_s: float = 60.0) -> None:
        """Until every live node says ``cluster_state:ok`` and sees the expected primaries."""

        def ok() -> bool:
            return len(self.primary_ports()) == self.primaries and all(
                "cluster_state:ok" in cli(n.port, "cluster", "info") for n in self.alive()
            )

        _wait("the cluster's state ok", ok, timeout_s)

    def kill_primary(self, port: int | None = None) -> int:
        """SIGKILL a primary (the first, or the one on ``port``); its port."""
        port = port or self.primary_ports()[0]
        node = next(n for n in self.nodes if n.port == port)
        assert node.proc is not None
        stop(node.proc, signal.SIGKILL)
        return port

    def primary_of(self, key: str) -> int:
        """The port of the primary that holds ``key``'s hash slot now."""
        slot = cli(self.alive()[0].port, "cluster", "keyslot", key).strip()
        for parts in self._nodes():
            if "master" in parts[2] and "fail" not in parts[2]:
                for r in parts[8:]:
                    low, _, high = r.partition("-")
                    if low.isdigit() and int(low) <= int(slot) <= int(high or low):
                        return int(parts[1].split("@")[0].rsplit(":", 1)[1])
        raise LookupError(f"no primary holds slot {slot}")

    def _nodes(self) -> list[list[str]]:
        return [line.split() for line in cli(self.alive()[0].port, "cluster", "nodes").splitlines()]

    def node_id(self, port: int) -> str:
        return cli(port, "cluster", "myid").strip()

    def migrate_slot(self, key: str, to_port: int, batch: int = 1, between: Any = None) -> None:
        """Move ``key``'s hash slot to the primary on ``to_port`` as resharding does: IMPORTING /
        MIGRATING, the keys ``batch`` at a time (``between()`` after each batch: clients see ASK
        meanwhile), then the slot's new owner announced to every primary (clients see MOVED)."""
        slot = cli(self.alive()[0].port, "cluster", "keyslot", key).strip()
        src = self.primary_of(key)
        src_id, dst_id = self.node_id(src), self.node_id(to_port)
        cli(to_port, "cluster", "setslot", slot, "importing", src_id)
        cli(src, "cluster", "setslot", slot, "migrating", dst_id)
        while keys := cli(src, "cluster", "getkeysinslot", slot, str(batch)).split():
            cli(src, "migrate", "127.0.0.1", str(to_port), "", "0", "5000", "keys", *keys)
            if between is not None:
                between()
        for port in self.primary_ports():
            cli(port, "cluster", "setslot", slot, "node", dst_id)

    def kill_shard(self, port: int) -> None:
        """SIGKILL a primary and its replicas: its slots have no primary left."""
        nodes = self._nodes()
        primary = next(p[0] for p in nodes if p[1].split("@")[0].endswith(f":{port}"))
        doomed = {port} | {int(p[1].split("@")[0].rsplit(":", 1)[1]) for p in nodes if p[3] == primary}
        for node in self.nodes:
            if node.port in doomed and node.proc is not None:
                stop(node.proc, signal.SIGKILL)

    def wait_promoted(self, dead: int, timeout_s: float = 60.0) -> None:
        """Until a replica replaced the dead primary and the cluster is ok again."""
        _wait(
            "a replica promoted",
            lambda: dead not in self.primary_ports() and len(self.primary_ports()) == self.primaries,
            timeout_s,
        )
        self.wait_ok(timeout_s)

    def flush(self) -> None:
        for port in self.primary_ports():
            cli(port, "flushall")

    def used_memory(self) -> int:
        """The primaries' ``used_memory``, summed."""
        total = 0
        for port in self.primary_ports():
            for line in cli(port, "info", "memory").splitlines():
                if line.startswith("used_memory:"):
                    total += int(line.split(":")[1])
        return total

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()


class SentinelProcesses:
    """A master, one replica, and three sentinels (quorum 2) watching them as ``master``."""

    def __init__(self, data: Path, master: str = "slotkeeper", server: str = "redis") -> None:
        self.name = master
        self.master = _Node(data / "master", [], server)
        self.replica = _Node(data / "replica", ["--replicaof", "127.0.0.1", str(self.master.port)], server)
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.data = data
        self.sentinels: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis-sentinel://{hosts}/{self.name}"

    def start(self) -> None:
        self.master.start()
        self.replica.start()
        _wait("the replica in sync", lambda: "master_link_status:up" in self.replica.info("replication"))
        for port in self.sentinel_ports:
            conf = self.data / f"sentinel-{port}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {self.data}\n"
                f"sentinel monitor {self.name} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {self.name} {NODE_TIMEOUT_MS}\n"
                f"sentinel failover-timeout {self.name} 10000\n"
                f"sentinel parallel-syncs {self.name} 1\n"
            )
            with open(self.data / f"sentinel-{port}.log", "ab") as log:
                self.sentinels.append(
                    subprocess.Popen(
                        [self.master.binary, str(conf), "--sentinel"],
                        stdout=log,
                        stderr=log,
                        start_new_session=True,
                    )
                )
        _wait("the sentinels agreeing", lambda: all(self._sees_all(p) for p in self.sentinel_ports))

    def _sees_all(self, port: int) -> bool:
        info = cli(port, "info", "sentinel")
        return (
            f"address=127.0.0.1:{self.master.port}" in info and "sentinels=3" in info and "slaves=1" in info
        )

    def master_port(self) -> int:
        """The master's port as the sentinels name it now."""
        for port in self.sentinel_ports:
            out = cli(port, "sentinel", "get-master-addr-by-name", self.name).split()
            if len(out) == 2:
                return int(out[1])
        return 0

    def kill_master(self) -> int:
        port = self.master_port()
        node = self.master if self.master.port == port else self.replica
        assert node.proc is not None
        stop(node.proc, signal.SIGKILL)
        return port

    def wait_promoted(self, dead: int, timeout_s: float = 60.0) -> None:
        def promoted() -> bool:
            port = self.master_port()
            return port not in (0, dead) and "role:master" in cli(port, "info", "replication")

        _wait("the sentinels' failover", promoted, timeout_s)

    def flush(self) -> None:
        cli(self.master_port(), "flushall")

    def kill(self) -> None:
        for proc in self.sentinels:
            stop(proc, signal.SIGKILL)
        self.master.kill()
        self.replica.kill()


@contextmanager
def redis_cluster(
    data: Path, primaries: int = 3, replicas: int = 1, server: str = "redis"
) -> Iterator[ClusterProcesses]:
    """A cluster of ``server`` nodes (redis, or valkey: harness.servers.server_binary)."""
    cluster = ClusterProcesses(data, primaries, replicas, server)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.kill()


@contextmanager
def redis_sentinel(data: Path, server: str = "redis") -> Iterator[SentinelProcesses]:
    setup = SentinelProcesses(data, server=server)
    try:
        setup.start()
        yield setup
    finally:
        setup.kill()

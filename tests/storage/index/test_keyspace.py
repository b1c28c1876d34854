"""storage.index.keyspace's error mapping: what redis-py raises leaves as the storage error a
caller can act on (503 for what passes, a misconfiguration for what does not)."""

from __future__ import annotations

import pytest
from redis.exceptions import (
    AuthenticationError,
    ClusterDownError,
    ConnectionError,
    RedisClusterException,
    RedisClusterUnreachableError,
    ResponseError,
)

from storage.errors import StorageError, StoreMisconfigured, StoreUnavailable
from storage.index.keyspace import redis_error, redis_errors


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (ConnectionError("refused"), StoreUnavailable),
        (ClusterDownError("CLUSTERDOWN"), StoreUnavailable),
        (ResponseError("OOM command not allowed"), StoreUnavailable),
        # Every seed node of a cluster down, or refusing the client's TLS: not a RedisError at all.
        (RedisClusterUnreachableError("Redis Cluster cannot be connected"), StoreUnavailable),
        (AuthenticationError("WRONGPASS"), StoreMisconfigured),
        (RedisClusterException("something else"), StorageError),
    ],
)
async def test_redis_errors_leave_as_storage_errors(raised: Exception, expected: type[StorageError]) -> None:
    assert type(redis_error(raised)) is expected
    with pytest.raises(expected):
        async with redis_errors():
            raise raised

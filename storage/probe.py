"""Start-up probes: find a misconfigured blob store or Redis before the first tenant does.

Both are meant to be awaited once in a process's start-up (the Starlette lifespan, the node
agent's start), before it reports ready. They raise a precise error instead of letting the first
save fail minutes later:

* :class:`StoreMisconfigured` (status 500, code ``store_misconfigured``) when the service answers
  but refuses: a missing or invalid bucket, wrong credentials, no permission, a read-only Redis
  replica. Its ``error_code`` is the server's code and its message names the bucket and endpoint
  (or directory, or Redis address). Retrying does not help; fix the configuration.
* :class:`StoreUnavailable` (503) when the service cannot be reached after the store's retries.
"""

from __future__ import annotations

import sys
import uuid
import zlib
from typing import Any

import structlog
from redis.exceptions import ResponseError

from storage.blobs.blobstore import BlobStore
from storage.errors import StorageError, StoreMisconfigured
from storage.index.keyspace import REDIS_FAILURES, Keyspace, redis_address, redis_error, text

log = structlog.get_logger("slotkeeper.storage")
MIN_REDIS_VERSION = (7, 0)  # PEXPIRE NX/GT (in-flight admission)


async def probe_store(store: BlobStore) -> None:
    """Write, read back (checksum verified) and delete a small object under the store's prefix
    (``{prefix}/.probe/{uuid}``: outside every tenant, invisible to listings and ``reindex``).

    The S3 store also lists the object and probes conditional writes, so every permission the
    store needs (PutObject, GetObject, ListBucket, DeleteObject, multipart) is exercised once.
    """
    await store.probe()


def check_read_back(written: bytes, got: bytes, said: str, *, service: str, where: str) -> None:
    """A store probe's last check: :class:`StoreMisconfigured` saying ``said`` unless what it read
    back is what it wrote."""
    if zlib.crc32(got) != zlib.crc32(written) or len(got) != len(written):
        raise StoreMisconfigured(said, service=service, error_code="ChecksumMismatch", where=where)


async def probe_redis(redis: Any, *, prefix: str = "slotkeeper") -> None:
    """PING, then a SET/GET/DEL round trip on ``{prefix}:probe:{uuid}`` (with a TTL, so nothing
    lingers if the DEL never runs), and a server version check where the server reports one."""
    where = redis_address(redis)
    key = f"{Keyspace(prefix).prefix}:probe:{uuid.uuid4().hex}"
    value = uuid.uuid4().hex
    try:
        await redis.ping()
        await redis.set(key, value, px=30_000)
        got = await redis.get(key)
        await redis.delete(key)
        version = await _server_version(redis)
    except REDIS_FAILURES as exc:
        raise redis_error(exc, where) from exc
    if got is None or text(got) != value:
        raise StoreMisconfigured(
            f"{where} did not return the value just written to {key}",
            service="redis",
            error_code="GetMismatch",
            where=where,
        )
    if version is not None and version < MIN_REDIS_VERSION:
        have, need = ".".join(map(str, version)), ".".join(map(str, MIN_REDIS_VERSION))
        raise StoreMisconfigured(
            f"{where} runs Redis {have}; Slotkeeper needs {need} or later",
            service="redis",
            error_code="RedisVersion",
            where=where,
        )
    log.info("storage.probed", store="redis", where=where)


async def _server_version(redis: Any) -> tuple[int, ...] | None:
    """``redis_version`` from INFO; None where INFO is not implemented (the in-process Redis)."""
    try:
        info = await redis.info("server")
    except ResponseError as exc:
        if "unknown command" in str(exc).lower():
            return None
        raise
    raw = str(info.get("redis_version", ""))
    try:
        return tuple(int(p) for p in raw.split(".")[:2])
    except ValueError:
        return None


async def check_backends(store: BlobStore, redis: Any, prefix: str, who: str) -> None:
    """Write, read and delete a probe in the store and in Redis; a failure is logged with its precise
    cause (and printed for whoever started the process) and stops the start."""
    try:
        await probe_store(store)
        await probe_redis(redis, prefix=prefix)
    except StorageError as exc:
        log.error(f"{who}.misconfigured", error=str(exc))
        print(f"slotkeeper {who}: cannot start: {exc}", file=sys.stderr)
        raise

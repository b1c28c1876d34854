"""Redis key names, transactions and the in-process Redis, shared by the index, locks and engines.

Every key starts with a configurable prefix and continues with a Redis Cluster hash tag, the part
in braces that alone decides a key's hash slot: every per-tenant key with ``{t:TENANT}``, so a
tenant's scripts and transactions are single-slot and tenants spread over a cluster's shards; an
engine's occupancy (its live set and idle LRU) with ``{e:ENGINE}``; the engine registry and the
index's epochs with ``{g}``. Ids are validated by :func:`storage.ids.validate_id`, which rejects
``:`` and braces, so one tenant's key can never be spelled through another tenant's ids, nor can an
id pick another tag's slot. On one primary the tags are ordinary characters: the same layout.
Multi-key changes go through :func:`transact` (WATCH/MULTI/EXEC with retry on contention): it works
the same on redis-server and on fakeredis, which runs no Lua without the optional ``lupa`` package.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from redis.exceptions import (
    AuthenticationError,
    ClusterDownError,
    NoPermissionError,
    ReadOnlyError,
    RedisClusterException,
    RedisClusterUnreachableError,
    RedisError,
    TryAgainError,
    WatchError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from storage.errors import StorageError, StoreMisconfigured, StoreUnavailable, WriteConflict
from storage.ids import validate_id

T = TypeVar("T")
# What redis-py raises when a server fails a call: its own errors, and a cluster's that are not one
# of them (a cluster none of whose nodes can be reached: all down, or refusing the client's TLS).
REDIS_FAILURES = (RedisError, RedisClusterException)
# an engine's idle LRU and live set: `Keyspace.occupancy_prefix()` + the engine id + suffix
IDLE, LIVE = "}:idle", "}:live"
_PREFIX = re.compile(r"[A-Za-z0-9_.\-]{1,64}(:[A-Za-z0-9_.\-]{1,64})*")


@dataclass(frozen=True)
class Keyspace:
    """Key names under ``prefix`` (``slotkeeper`` by default)."""

    prefix: str = "slotkeeper"

    def __post_init__(self) -> None:
        if not _PREFIX.fullmatch(self.prefix):
            raise ValueError(f"invalid Redis key prefix {self.prefix!r}")

    def tenant(self, tenant: str) -> str:
        """What every key of the tenant starts with: the prefix and the tenant's hash tag."""
        return f"{self.prefix}:{{t:{validate_id(tenant, 'tenant id')}}}"

    def tenant_parts(self) -> tuple[str, str]:
        """What goes before and after a tenant id in :meth:`tenant` (Lua builds keys from them)."""
        return f"{self.prefix}:{{t:", "}"

    def _global(self) -> str:
        """The registry's and the index epochs' keys: one slot, apart from every tenant's."""
        return f"{self.prefix}:{{g}}"

    def session(self, tenant: str, session: str) -> str:
        return f"{self.session_prefix(tenant)}{validate_id(session, 'session id')}"

    def session_prefix(self, tenant: str) -> str:
        """What the tenant's session records' keys start with (Lua builds keys from it)."""
        return f"{self.tenant(tenant)}:s:"

    def sessions(self, tenant: str) -> str:
        """ZSET of the tenant's session ids scored by last use."""
        return f"{self.tenant(tenant)}:sessions"

    def stored_bytes(self, tenant: str) -> str:
        """Integer: unique bytes the store holds for the tenant (see storage.chunks.ledger)."""
        return f"{self.tenant(tenant)}:stored_bytes"

    def floor(self, tenant: str, session: str) -> str:
        """Integer left by a deleted session: the highest generation its id has used."""
        return f"{self.tenant(tenant)}:floor:{validate_id(session, 'session id')}"

    def prefix_hash(self, tenant: str, digest: str) -> str:
        """STRING (with a TTL): the session a message-prefix digest routes to."""
        return f"{self.tenant(tenant)}:px:{digest}"

    def shared_prefix(self, tenant: str, digest: str) -> str:
        """STRING (with a TTL): a session holding the state of a shared prefix
        (:mod:`storage.index.shared_prefixes`)."""
        return f"{self.tenant(tenant)}:pp:{digest}"

    def session_prefixes(self, tenant: str, session: str) -> str:
        """ZSET (with a TTL) of the routing keys pointing at a session, newest last: ``px:`` and
        ``pp:`` + a digest (:mod:`storage.index.prefix_digests`: kept bounded, deleted with it)."""
        return f"{self.tenant(tenant)}:sx:{validate_id(session, 'session id')}"

    def tenant_live(self, tenant: str) -> str:
        """HASH session -> engine of the tenant's live sessions (its live-slot quota, sampled
        pool views)."""
        return f"{self.tenant(tenant)}:live"

    def lock(self, tenant: str, session: str) -> str:
        return f"{self.tenant(tenant)}:lock:{validate_id(session, 'session id')}"

    def usage(self, tenant: str) -> str:
        """HASH of lifetime usage counters."""
        return f"{self.tenant(tenant)}:usage"

    def window(self, tenant: str, name: str, window_ms: int, number: int) -> str:
        """Integer counter of window ``number`` (``now // window``), expiring after it ends."""
        return f"{self.tenant(tenant)}:w:{name}:{window_ms}:{number}"

    def inflight(self, tenant: str) -> str:
        """ZSET of the tenant's running requests' tokens, scored by expiry (ms)."""
        return f"{self.tenant(tenant)}:inflight"

    def engines(self) -> str:
        """ZSET of engine ids scored by heartbeat expiry (ms)."""
        return f"{self._global()}:engines"

    def registry_epoch(self) -> str:
        """Integer bumped whenever an engine joins or leaves the registry (gateways cache it)."""
        return f"{self._global()}:engines:epoch"

    def index_epoch(self) -> str:
        """STRING: the index's epoch, a random token (storage.index.epoch): gone with a lost index."""
        return f"{self._global()}:index:epoch"

    def index_built(self) -> str:
        """STRING: the epoch whose index was rebuilt from the store (storage.index.epoch)."""
        return f"{self._global()}:index:built"

    def index_lease(self) -> str:
        """STRING (with a TTL): the lease of the one process rebuilding the index."""
        return f"{self._global()}:index:rebuilding"

    def engine(self, engine_id: str) -> str:
        """HASH (with a TTL): the engine as it registered (in the registry's slot)."""
        return f"{self._global()}:e:{validate_id(engine_id, 'engine id')}"

    def occupancy_prefix(self) -> str:
        """What an engine's occupancy keys start with: a script that learns an engine id from a
        record it read builds that engine's keys from it (``occupancy_prefix() + id + IDLE`` /
        ``LIVE``)."""
        return f"{self.prefix}:{{e:"

    def engine_idle(self, engine_id: str) -> str:
        """ZSET of ``tenant:session`` idle on the engine, scored by last use (the LRU)."""
        return f"{self.occupancy_prefix()}{validate_id(engine_id, 'engine id')}{IDLE}"

    def engine_live(self, engine_id: str) -> str:
        """SET of ``tenant:session`` live (busy or idle) on the engine."""
        return f"{self.occupancy_prefix()}{validate_id(engine_id, 'engine id')}{LIVE}"


def member(tenant: str, session: str) -> str:
    """The ``tenant:session`` member of an engine's sets (unambiguous: ids have no ``:``)."""
    return f"{validate_id(tenant, 'tenant id')}:{validate_id(session, 'session id')}"


def parse_member(value: str) -> tuple[str, str]:
    tenant, _, session = value.partition(":")
    return tenant, session


def text(value: Any) -> str:
    """A Redis reply as str, whether the client decodes responses or not."""
    return value.decode() if isinstance(value, bytes) else str(value)


def text_map(reply: dict[Any, Any]) -> dict[str, str]:
    return {text(k): text(v) for k, v in reply.items()}


# redis-py exceptions that no retry fixes, with the code StoreMisconfigured reports
_REDIS_CONFIG_ERRORS = (
    (AuthenticationError, "AUTH"),
    (NoPermissionError, "NOPERM"),
    (ReadOnlyError, "READONLY"),
)


def redis_address(redis: Any) -> str:
    """``host:port/db`` (or the socket path) of a redis-py client, for error messages; the
    in-process index (fakeredis: its "host" is a random server name) says that it is one."""
    if type(redis).__module__.startswith("fakeredis"):
        return "the in-process index (no Redis server)"
    startup = getattr(getattr(redis, "nodes_manager", None), "startup_nodes", None)
    if startup:  # a cluster client: its seed nodes
        return "redis cluster at " + ",".join(sorted(startup))
    service = getattr(getattr(redis, "connection_pool", None), "service_name", None)
    if service:  # a Sentinel-managed client
        return f"redis sentinel master {service}"
    kwargs = getattr(getattr(redis, "connection_pool", None), "connection_kwargs", {}) or {}
    if kwargs.get("path"):
        return f"redis at {kwargs['path']}/{kwargs.get('db', 0)}"
    if "host" in kwargs or "port" in kwargs:
        return f"redis at {kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"
    return "redis (in-process)"


def redis_error(exc: Exception, where: str = "redis") -> StorageError:
    """The storage error a redis-py exception stands for: refused credentials or permissions and
    read-only replicas are :class:`StoreMisconfigured`, connection failures, timeouts, a full
    server (``OOM``), a cluster slot without a primary (``CLUSTERDOWN``) and one being moved
    (``TRYAGAIN``, once redis-py's own retries are spent) and a cluster none of whose nodes can be
    reached :class:`StoreUnavailable`, anything else a plain :class:`StorageError`."""
    for cls, code in _REDIS_CONFIG_ERRORS:
        if isinstance(exc, cls):
            return StoreMisconfigured(f"{where}: {exc}", service="redis", error_code=code, where=where)
    transient = (
        RedisConnectionError
        | RedisTimeoutError
        | ClusterDownError
        | TryAgainError
        | RedisClusterUnreachableError
    )
    if isinstance(exc, transient) or str(exc).startswith("OOM"):
        return StoreUnavailable(f"{where}: {exc}")
    return StorageError(f"{where}: {exc}")


@asynccontextmanager
async def redis_errors() -> AsyncIterator[None]:
    """redis-py exceptions leave as storage errors (see :func:`redis_error`)."""
    try:
        yield
    except REDIS_FAILURES as exc:  # WatchError never gets here: transact() handles it inside
        raise redis_error(exc) from exc


async def transact(
    redis: Any, watch: Sequence[str], body: Callable[[Any], Awaitable[T]], *, attempts: int = 64
) -> T:
    """Run ``body(pipe)`` as an optimistic transaction over the ``watch``ed keys.

    ``body`` reads in immediate mode, then calls ``pipe.multi()`` and queues its writes; it is
    rerun when a watched key changed before EXEC, or when its slot was being moved to another
    cluster node (``TRYAGAIN``: some of its keys there already). Raising inside ``body`` aborts with
    no writes.
    """
    async with redis_errors():
        for attempt in range(attempts):
            async with redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(*watch)
                    result = await body(pipe)
                    await pipe.execute()
                    return result
                except (WatchError, TryAgainError):
                    await asyncio.sleep(0.001 * min(attempt, 10))
    raise WriteConflict(f"too much contention on {list(watch)}")


def in_process_redis(server: Any = None) -> Any:
    """The in-process default for a single machine: a fakeredis client with its own server.

    Behaves like redis-server for everything the index uses (TTLs included) but lives in this
    process only: nothing survives a restart, so the single-machine setup runs ``reindex`` at
    start-up to rebuild it from the blob store. Pass a ``fakeredis.FakeServer`` to share one
    in-process server between several clients.
    """
    import fakeredis

    return fakeredis.FakeAsyncRedis(server=server or fakeredis.FakeServer(), decode_responses=True)

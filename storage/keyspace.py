"""Redis key names, transactions and the in-process Redis, shared by the index, locks and engines.

Every key starts with a configurable prefix; every per-tenant key continues with ``:t:{tenant}:``.
Ids are validated by :func:`storage.ids.validate_id`, which rejects ``:``, so one tenant's key can
never be spelled through another tenant's ids. Multi-key changes go through :func:`transact`
(WATCH/MULTI/EXEC with retry on contention): it works the same on redis-server and on fakeredis,
which runs no Lua without the optional ``lupa`` package.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.exceptions import WatchError

from storage.errors import Conflict, StoreUnavailable
from storage.ids import validate_id

T = TypeVar("T")
_PREFIX = re.compile(r"[A-Za-z0-9_.\-]{1,64}(:[A-Za-z0-9_.\-]{1,64})*")


@dataclass(frozen=True)
class Keyspace:
    """Key names under ``prefix`` (``slotkeeper`` by default)."""

    prefix: str = "slotkeeper"

    def __post_init__(self) -> None:
        if not _PREFIX.fullmatch(self.prefix):
            raise ValueError(f"invalid Redis key prefix {self.prefix!r}")

    def tenant(self, tenant: str) -> str:
        return f"{self.prefix}:t:{validate_id(tenant, 'tenant id')}"

    def session(self, tenant: str, session: str) -> str:
        return f"{self.tenant(tenant)}:s:{validate_id(session, 'session id')}"

    def sessions(self, tenant: str) -> str:
        """ZSET of the tenant's session ids scored by last use."""
        return f"{self.tenant(tenant)}:sessions"

    def prefix_hash(self, tenant: str, digest: str) -> str:
        return f"{self.tenant(tenant)}:px:{digest}"

    def session_prefixes(self, tenant: str, session: str) -> str:
        """SET of the prefix digests pointing at a session (to delete them with it)."""
        return f"{self.tenant(tenant)}:sx:{validate_id(session, 'session id')}"

    def lock(self, tenant: str, session: str) -> str:
        return f"{self.tenant(tenant)}:lock:{validate_id(session, 'session id')}"

    def usage(self, tenant: str) -> str:
        return f"{self.tenant(tenant)}:usage"

    def engines(self) -> str:
        """ZSET of engine ids scored by heartbeat expiry (ms)."""
        return f"{self.prefix}:engines"

    def engine(self, engine_id: str) -> str:
        return f"{self.prefix}:e:{validate_id(engine_id, 'engine id')}"

    def engine_idle(self, engine_id: str) -> str:
        """ZSET of ``tenant:session`` idle on the engine, scored by last use (the LRU)."""
        return f"{self.engine(engine_id)}:idle"

    def engine_live(self, engine_id: str) -> str:
        """SET of ``tenant:session`` live (busy or idle) on the engine."""
        return f"{self.engine(engine_id)}:live"


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


@asynccontextmanager
async def redis_errors() -> AsyncIterator[None]:
    """Connection failures and timeouts leave as :class:`StoreUnavailable`."""
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError) as exc:
        raise StoreUnavailable(f"redis: {exc}") from exc


async def transact(
    redis: Any, watch: Sequence[str], body: Callable[[Any], Awaitable[T]], *, attempts: int = 64
) -> T:
    """Run ``body(pipe)`` as an optimistic transaction over the ``watch``ed keys.

    ``body`` reads in immediate mode, then calls ``pipe.multi()`` and queues its writes; it is
    rerun when a watched key changed before EXEC. Raising inside ``body`` aborts with no writes.
    """
    async with redis_errors():
        for attempt in range(attempts):
            async with redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(*watch)
                    result = await body(pipe)
                    await pipe.execute()
                    return result
                except WatchError:
                    await asyncio.sleep(0.001 * min(attempt, 10))
    raise Conflict(f"too much contention on {list(watch)}")


def in_process_redis(server: Any = None) -> Any:
    """The in-process default for a single machine: a fakeredis client with its own server.

    Behaves like redis-server for everything the index uses (TTLs included) but lives in this
    process only: nothing survives a restart, so the single-machine setup runs ``reindex`` at
    start-up to rebuild it from the blob store. Pass a ``fakeredis.FakeServer`` to share one
    in-process server between several clients.
    """
    import fakeredis

    return fakeredis.FakeAsyncRedis(server=server or fakeredis.FakeServer(), decode_responses=True)

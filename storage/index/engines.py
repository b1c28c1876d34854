"""The engine registry on Redis: engines announce themselves and stay listed while they heartbeat.

Each engine is a hash with a TTL (``PEXPIRE``) that every heartbeat pushes forward, plus a member
of a ZSET scored by its expiry so that listing needs no ``SCAN``. The hash's existence is the
truth: a heartbeat after expiry returns False (the engine must register again, and whoever owns
placement should treat its slots as lost — see :meth:`storage.index.session_index.SessionIndex.drop_engine`).
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import structlog

from storage.ids import validate_id
from storage.index.keyspace import Keyspace, redis_errors, text, text_map, transact

log = structlog.get_logger("slotkeeper.storage")


@dataclass(frozen=True)
class EngineInfo:
    engine_id: str
    node: str
    url: str
    model: str
    n_slots: int
    registered: float
    last_heartbeat: float
    expires: float = 0.0  # when it leaves the listing unless it heartbeats again (seconds)
    # The engine process's instance id ('' unknown): new at every start, so a request that names
    # it (X-Slotkeeper-Instance) never runs on a restarted engine whose slots hold other sessions.
    instance: str = ""
    role: str = "mixed"  # prefill | decode | mixed: a prefill engine holds no session


def _ms(seconds: float) -> int:
    if seconds <= 0:
        raise ValueError("ttl must be > 0")
    return max(1, round(seconds * 1000))


class EngineRegistry:
    """Engines alive within their heartbeat TTL; engine ids follow the id rules."""

    def __init__(
        self, redis: Any, *, prefix: str = "slotkeeper", clock: Callable[[], float] = time.time
    ) -> None:
        self._redis = redis
        self.keys = Keyspace(prefix)
        self._clock = clock

    async def register(
        self,
        engine_id: str,
        *,
        node: str,
        url: str,
        model: str,
        n_slots: int,
        ttl_s: float,
        instance: str = "",
        role: str = "mixed",
    ) -> EngineInfo:
        """Announce (or re-announce) an engine; it stays listed for ``ttl_s`` without heartbeats.
        ``instance``: its process's instance id, ``role`` its role (see :class:`EngineInfo`)."""
        validate_id(node, "node id")
        now = self._clock()
        info = EngineInfo(
            validate_id(engine_id, "engine id"),
            node,
            url,
            model,
            n_slots,
            now,
            now,
            instance=instance,
            role=role,
        )
        key = self.keys.engine(engine_id)
        fields = {
            "node": node,
            "url": url,
            "model": model,
            "n_slots": str(n_slots),
            "registered": str(now),
            "last_heartbeat": str(now),
            "instance": instance,
            "role": role,
        }
        async with redis_errors(), self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping=fields)
            pipe.pexpire(key, _ms(ttl_s))
            pipe.zadd(self.keys.engines(), {engine_id: (now + ttl_s) * 1000})
            pipe.incr(self.keys.registry_epoch())
            await pipe.execute()
        log.info("engine.registered", engine=engine_id, node=node, model=model, n_slots=n_slots)
        return info

    async def heartbeat(self, engine_id: str, *, ttl_s: float) -> bool:
        """Extend the engine's TTL; False when it already expired (register again)."""
        key = self.keys.engine(engine_id)
        now = self._clock()

        async def body(pipe: Any) -> bool:
            alive = await pipe.pttl(key) != -2  # (not EXISTS: a cluster pipeline drops it here)
            pipe.multi()
            if alive:
                pipe.hset(key, "last_heartbeat", str(now))
                pipe.pexpire(key, _ms(ttl_s))
                pipe.zadd(self.keys.engines(), {engine_id: (now + ttl_s) * 1000})
            else:
                pipe.zrem(self.keys.engines(), engine_id)
                pipe.incr(self.keys.registry_epoch())
            return alive

        alive = await transact(self._redis, [key], body)
        if not alive:
            log.warning("engine.expired", engine=engine_id)
        return alive

    def now(self) -> float:
        """The registry's clock (engine expiries are on it)."""
        return self._clock()

    async def get(self, engine_id: str) -> EngineInfo | None:
        async with redis_errors():
            raw = await self._redis.hgetall(self.keys.engine(engine_id))
        return self._info(engine_id, raw) if raw else None

    async def list(self, model: str | None = None) -> list[EngineInfo]:
        """Engines whose TTL has not run out (optionally serving ``model``), by id."""
        _, infos = await self.listing()
        return [i for i in infos if model is None or i.model == model]

    async def listing(self) -> tuple[int, builtins.list[EngineInfo]]:
        """Every engine whose TTL has not run out, by id, with the registry's epoch read in the
        same round trip (:meth:`epoch` changing tells a cached listing is out of date)."""
        now_ms = self._clock() * 1000
        async with redis_errors():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.zremrangebyscore(self.keys.engines(), "-inf", now_ms)
                pipe.zrangebyscore(self.keys.engines(), now_ms, "+inf", withscores=True)
                pipe.get(self.keys.registry_epoch())
                _, listed, epoch = await pipe.execute()
            expiry = {text(i): float(score) / 1000 for i, score in listed}
            async with self._redis.pipeline(transaction=False) as pipe:
                for engine_id in expiry:
                    pipe.hgetall(self.keys.engine(engine_id))
                replies = await pipe.execute()
        infos = [
            replace(self._info(i, raw), expires=expiry[i])
            for i, raw in zip(expiry, replies, strict=True)
            if raw
        ]
        return int(epoch or 0), sorted(infos, key=lambda i: i.engine_id)

    async def epoch(self) -> int:
        """Bumped by every registration, unregistration and expiry noticed by a heartbeat."""
        async with redis_errors():
            return int(await self._redis.get(self.keys.registry_epoch()) or 0)

    async def unregister(self, engine_id: str) -> None:
        async with redis_errors(), self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.engine(engine_id))
            pipe.zrem(self.keys.engines(), engine_id)
            pipe.incr(self.keys.registry_epoch())
            await pipe.execute()
        log.info("engine.unregistered", engine=engine_id)

    @staticmethod
    def _info(engine_id: str, raw: Any) -> EngineInfo:
        h = text_map(raw)
        return EngineInfo(
            engine_id,
            h.get("node", ""),
            h.get("url", ""),
            h.get("model", ""),
            int(h.get("n_slots", 0)),
            float(h.get("registered", 0)),
            float(h.get("last_heartbeat", 0)),
            instance=h.get("instance", ""),
            role=h.get("role", "mixed"),
        )

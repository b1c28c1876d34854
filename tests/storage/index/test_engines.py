"""storage.index.engines on a real redis-server and on the in-process default."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from storage.errors import InvalidId
from storage.index.engines import EngineRegistry


@pytest.fixture
def registry(redis_client: Any) -> EngineRegistry:
    return EngineRegistry(redis_client, prefix="sk")


async def test_register_list_heartbeat_expire(registry: EngineRegistry, eventually: Any) -> None:
    await registry.register("e1", node="n1", url="http://127.0.0.1:1", model="fpA", n_slots=4, ttl_s=0.3)
    await registry.register("e2", node="n1", url="http://127.0.0.1:2", model="fpB", n_slots=2, ttl_s=5)
    assert [e.engine_id for e in await registry.list()] == ["e1", "e2"]
    assert [e.engine_id for e in await registry.list(model="fpB")] == ["e2"]
    info = await registry.get("e1")
    assert info is not None and (info.node, info.n_slots, info.url) == ("n1", 4, "http://127.0.0.1:1")
    for _ in range(3):
        await asyncio.sleep(0.15)
        assert await registry.heartbeat("e1", ttl_s=0.3) is True
    assert [e.engine_id for e in await registry.list()] == ["e1", "e2"]

    async def e1_gone() -> bool:  # e1 stops heartbeating: gone from the listing and its entry expired
        # (the listing filters by the heartbeat's deadline, the entry by Redis's own TTL: a few ms apart)
        return [e.engine_id for e in await registry.list()] == ["e2"] and await registry.get("e1") is None

    await eventually(e1_gone, "an engine that stops heartbeating expires")
    assert await registry.heartbeat("e1", ttl_s=0.3) is False
    await registry.register("e1", node="n2", url="u", model="fpA", n_slots=1, ttl_s=5)
    assert (await registry.get("e1")).node == "n2"  # type: ignore[union-attr]
    await registry.unregister("e2")
    assert [e.engine_id for e in await registry.list()] == ["e1"]


async def test_ids_are_validated(registry: EngineRegistry) -> None:
    with pytest.raises(InvalidId):
        await registry.register("e/1", node="n", url="u", model="m", n_slots=1, ttl_s=1)
    with pytest.raises(InvalidId):
        await registry.heartbeat("e:1", ttl_s=1)

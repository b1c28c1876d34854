"""The gateway's warm turn: at most two Redis round trips (the opening read, which marks the session
busy in its slot, and the closing write), no registry listing, and a next turn that never waits for
the previous turn's write-behind save unless it needs the saved state.

The gateway runs in this process (uvicorn on a loopback port) with a redis-py client whose
connections count what they send (one send = one round trip: a pipeline or a script is one); the
node agent and its engine are a real `slotkeeper node` process on the same redis-server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
import uvicorn
from redis.asyncio.connection import Connection
from support.servers import INTERNAL_KEY, free_port, stop, wait_until

from gateway.app import build_app
from gateway.main import services
from gateway.metrics import Metrics
from gateway.services import Services
from gateway.settings import GatewaySettings

TENANTS = """
[tenants.lazy]
keys = ["key-lazy"]
durability = "on-evict"
[tenants.durable]
keys = ["key-durable"]
durability = "after-turn"
[tenants.limited]
keys = ["key-limited"]
durability = "after-turn"
[tenants.limited.quotas]
requests_per_minute = 1000
"""

pytestmark = pytest.mark.slow


class Sends:
    """What the gateway's Redis connections sent, by the asyncio task that sent it."""

    def __init__(self) -> None:
        self.log: list[tuple[str, bytes]] = []

    def task_names(self) -> Counter[str]:
        return Counter(name.split(":")[0] for name, _ in self.log)

    def request_path(self, since: int) -> list[str]:
        """Sends from `since` on (task: command), except those of the write-behind saves and of the
        retention loop (the collection a superseded generation asks for): work after the turn,
        coalesced across turns, not per turn."""
        background = ("write-behind", "retention")
        sent = self.log[since:]
        return [f"{name}: {_command(cmd)}" for name, cmd in sent if not name.startswith(background)]


def _command(packed: bytes) -> str:
    """The command name (and a script's first key) of a packed command."""
    parts = [p for p in packed.split(b"\r\n") if p and p[:1] not in (b"*", b"$")]
    return " ".join(p.decode(errors="replace") for p in parts[:2])


SENDS = Sends()


class CountingConnection(Connection):
    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        task = asyncio.current_task()
        first = command[0] if isinstance(command, list) and command else command
        summary = bytes(first)[:80] if isinstance(first, bytes | bytearray | memoryview) else b"?"
        SENDS.log.append((task.get_name() if task is not None else "-", summary))
        await super().send_packed_command(command, check_health)


@dataclasses.dataclass
class Gateway:
    url: str
    svc: Services
    engine_model: str


@pytest.fixture
async def gateway(tiny_model, redis_port: int, tmp_path: Path) -> AsyncIterator[Gateway]:
    prefix = f"fp{uuid.uuid4().hex[:8]}"
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    node_port = free_port()
    node_cmd = [sys.executable, "-m", "gateway.cli", "node", "--model", tiny_model("qwen35"), "--slots", "3",
                "--ctx", "2048", "--port", str(node_port), "--node-id", "n1", "--data-dir", str(tmp_path),
                "--redis-url", redis_url, "--redis-prefix", prefix, "--log-level", "warning"]  # fmt: skip
    node = _spawn(node_cmd, tmp_path / "node.log")
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    settings = GatewaySettings(
        nodes=(f"http://127.0.0.1:{node_port}",), redis_url=redis_url, redis_prefix=prefix,
        tenants=str(tenants), internal_key=INTERNAL_KEY, data_dir=str(tmp_path),
    )  # fmt: skip
    pool = aioredis.ConnectionPool.from_url(redis_url, connection_class=CountingConnection)
    redis = aioredis.Redis(connection_pool=pool)
    metrics = Metrics()
    held: dict[str, Services] = {}

    @contextlib.asynccontextmanager
    async def make() -> AsyncIterator[Services]:
        async with services(settings, metrics, redis=redis) as svc:
            held["svc"] = svc
            yield svc

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(make, metrics), host="127.0.0.1", port=port,
                                           log_config=None, access_log=False, lifespan="on"))  # fmt: skip
    task = asyncio.create_task(server.serve())
    url = f"http://127.0.0.1:{port}"
    try:
        await asyncio.to_thread(wait_until, lambda: _ready(url), node, "node + in-process gateway", 120)
        auth = {"Authorization": f"Bearer {INTERNAL_KEY}"}
        async with httpx.AsyncClient() as c:
            engines = (await c.get(f"http://127.0.0.1:{node_port}/v1/engines", headers=auth)).json()[
                "engines"
            ]
        yield Gateway(url, held["svc"], engines[0]["model"])
    finally:
        server.should_exit = True
        await task
        await redis.aclose()
        await pool.aclose()  # a pool passed in is not the client's to close
        stop(node)


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "SLOTKEEPER_INTERNAL_KEY": INTERNAL_KEY}
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=2).json().get("engines", 0) >= 1
    except (httpx.HTTPError, ValueError):
        return False


async def _settled(svc: Services) -> None:
    """The gateway's bookkeeping and saves are done (every hold released)."""
    await asyncio.wait_for(svc.runner.drain(), 60)


def _body(model: str, text: str) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 1,
        "temperature": 0,
    }


async def _turn(c: httpx.AsyncClient, gw: Gateway, key: str, session: str, text: str) -> httpx.Response:
    resp = await c.post(gw.url + "/v1/chat/completions", json=_body(gw.engine_model, text),
                        headers={"Authorization": f"Bearer {key}", "X-Session-Id": session})  # fmt: skip
    assert resp.status_code == 200, resp.text
    return resp


@pytest.mark.parametrize("key", ["key-lazy", "key-durable", "key-limited"])
async def test_a_warm_turn_makes_at_most_two_redis_round_trips(gateway: Gateway, key: str) -> None:
    async with httpx.AsyncClient(timeout=60) as c:
        await _turn(c, gateway, key, "warm", "Say hi.")  # cold: placed, created, saved
        await _settled(gateway.svc)
        for i in range(3):
            since = len(SENDS.log)
            resp = await _turn(c, gateway, key, "warm", f"Say hi again ({i}).")
            assert resp.headers["x-slotkeeper-cache"] == "live"
            await _settled(gateway.svc)
            path = SENDS.request_path(since)
            assert len(path) <= 2, path
            assert not any("engines" in cmd for cmd in path)  # the registry is cached


async def test_the_next_turn_does_not_wait_for_the_previous_turns_save(gateway: Gateway) -> None:
    svc = gateway.svc
    gate = asyncio.Event()
    saving = asyncio.Event()
    real_spill = None

    async def slow_spill(*args: Any, **kwargs: Any) -> Any:
        saving.set()
        await gate.wait()  # the save hangs until the test lets it go
        assert real_spill is not None
        return await real_spill(*args, **kwargs)

    async with httpx.AsyncClient(timeout=60) as c:
        await _turn(c, gateway, "key-durable", "busy-saver", "Say hi.")
        await _settled(svc)
        node = next(iter(svc.runner.nodes.values()))
        real_spill = node.spill
        node.spill = slow_spill  # type: ignore[method-assign]
        try:
            await _turn(c, gateway, "key-durable", "busy-saver", "Turn two.")
            await asyncio.wait_for(saving.wait(), 10)  # its save is running (and stuck)
            # The next turns run on the live slot meanwhile: not forked, not waiting for the save,
            # taking the lock over from it (the opening read confirms it: still two round trips).
            for i in range(3):
                hold = svc.runner.holds.get("durable", "busy-saver")
                assert hold is not None
                await asyncio.wait_for(hold.booked.wait(), 10)  # the previous turn's bookkeeping
                since = len(SENDS.log)
                resp = await asyncio.wait_for(
                    _turn(c, gateway, "key-durable", "busy-saver", f"Turn {i + 3}."), 10
                )
                assert resp.headers["x-session-id"] == "busy-saver"
                assert resp.headers["x-slotkeeper-cache"] == "live"
                assert svc.runner.holds.get("durable", "busy-saver") is hold  # taken over, not re-locked
                await asyncio.wait_for(hold.booked.wait(), 10)
                path = SENDS.request_path(since)
                assert len(path) <= 2, path
            assert not gate.is_set()
        finally:
            gate.set()
            node.spill = real_spill  # type: ignore[method-assign]
        await _settled(svc)
    rec = await svc.index.get("durable", "busy-saver")
    # Saves coalesced: the stuck one, then one more with the newest state, which is durable now.
    assert rec.generation >= 2 and not rec.dirty

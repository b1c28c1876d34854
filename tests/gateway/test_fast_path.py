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
import contextvars
import dataclasses
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
import uvicorn
from redis.asyncio.connection import Connection

from gateway.app import build_app
from gateway.bench.harness.servers import INTERNAL_KEY, free_port, stop, wait_until
from gateway.bench.overhead import TENANTS_TOML
from gateway.main import services
from gateway.metrics import Metrics
from gateway.services import Services
from gateway.settings import GatewaySettings
from storage.index.records import SessionState

LIMITED = """
[tenants.limited]
keys = ["key-limited"]
durability = "after-turn"
[tenants.limited.quotas]
requests_per_minute = 1000
"""
# The benchmark's tenants (lazy and durable saves), and one with a request quota.
TENANTS = TENANTS_TOML + LIMITED

pytestmark = pytest.mark.slow


class Sends:
    """What the gateway's Redis connections sent, by the asyncio task that sent it."""

    def __init__(self) -> None:
        self.log: list[tuple[str, bytes]] = []

    def request_path(self, since: int) -> list[str]:
        """Sends from `since` on (task: command), except those of the write-behind saves, of a hold
        lingering after a turn no save follows (its lock released once the moment is over), of the
        retention loop (the collection a superseded generation asks for), of two timers whatever
        the traffic (the index's epoch watcher; a held lock's keeper, renewing it every third of
        its TTL) and a new connection's handshake (the pool grows when a turn's read meets every
        connection busy beside it: once per connection): work after or beside the turn, not per
        turn."""
        background = ("write-behind", "linger", "retention", "index-watch", "lock-keeper", HANDSHAKE)
        sent = self.log[since:]
        return [f"{name}: {_command(cmd)}" for name, cmd in sent if not name.startswith(background)]


def _command(packed: bytes) -> str:
    """The command name (and a script's first key) of a packed command."""
    parts = [p for p in packed.split(b"\r\n") if p and p[:1] not in (b"*", b"$")]
    return " ".join(p.decode(errors="replace") for p in parts[:2])


SENDS = Sends()


HANDSHAKE = "handshake"
_connecting: contextvars.ContextVar[bool] = contextvars.ContextVar("connecting", default=False)


class CountingConnection(Connection):
    async def on_connect_check_health(self, check_health: bool = True) -> None:
        token = _connecting.set(True)
        try:
            await super().on_connect_check_health(check_health)
        finally:
            _connecting.reset(token)

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        task = asyncio.current_task()
        first = command[0] if isinstance(command, list) and command else command
        summary = bytes(first)[:80] if isinstance(first, bytes | bytearray | memoryview) else b"?"
        name = task.get_name() if task is not None else "-"
        SENDS.log.append((f"{HANDSHAKE}:{name}" if _connecting.get() else name, summary))
        await super().send_packed_command(command, check_health)


@dataclasses.dataclass
class Gateway:
    url: str
    svc: Services
    engine_model: str
    node_url: str


class Walk:
    """The modules of the turn's package (`gateway.turn`) a request walks through from its route to
    the engine: every call from one module into a function of another that starts running in the
    request's context (a resumed coroutine is no new step; a module calling its own functions stays
    where it is), until the request's bytes go to the engine socket. `returns` counts the steps into
    a module the walk had already left: what a reader following the body must go back to."""

    HEADER = "x-test-walk"
    _walking: contextvars.ContextVar[bool] = contextvars.ContextVar("walking", default=False)

    def __init__(self) -> None:
        self.modules: list[str] = []
        self.done = False
        self._frames: list[Any] = []  # the walk's frames, held: a frame seen again is a coroutine resumed

    def start(self) -> None:
        self.modules, self.done, self._frames = [], False, []

    def app(self, app: Any) -> Any:
        """`app`, with the requests that carry `HEADER` walked."""

        async def walked(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and (self.HEADER.encode(), b"1") in scope.get("headers", []):
                self._walking.set(True)
            await app(scope, receive, send)

        return walked

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call" or self.done or not self._walking.get():
            return
        module = frame.f_globals.get("__name__", "")
        if module == "gateway.engine_http" and frame.f_code.co_name == "send":
            self.done = True  # the body is on its way to the engine
            return
        if not module.startswith("gateway.turn.") or any(f is frame for f in self._frames):
            return
        if frame.f_code.co_filename == "<string>":
            return  # a dataclass's generated __init__ or replace: data made, not a step taken
        self._frames.append(frame)
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back is not None else ""
        if caller != module and (not self.modules or self.modules[-1] != module):
            self.modules.append(module)

    @property
    def returns(self) -> int:
        return sum(1 for i, m in enumerate(self.modules) if m in self.modules[:i])


WALK = Walk()


@pytest.fixture
async def gateway(tiny_model, redis_port: int, tmp_path: Path) -> AsyncIterator[Gateway]:
    prefix = f"fp{uuid.uuid4().hex[:8]}"
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    node_port = free_port()
    node_cmd = [
        *(sys.executable, "-m", "gateway.cli", "node"),
        *("--model", tiny_model("qwen35")),
        *("--slots", "3"),
        *("--ctx", "2048"),
        *("--port", str(node_port)),
        *("--node-id", "n1"),
        *("--data-dir", str(tmp_path)),
        *("--redis-url", redis_url),
        *("--redis-prefix", prefix),
        *("--log-level", "warning"),
    ]
    node = _spawn(node_cmd, tmp_path / "node.log")
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    settings = GatewaySettings(
        nodes=(f"http://127.0.0.1:{node_port}",),
        redis_url=redis_url,
        redis_prefix=prefix,
        tenants=str(tenants),
        internal_key=INTERNAL_KEY,
        data_dir=str(tmp_path),
    )
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
    server = uvicorn.Server(
        uvicorn.Config(
            WALK.app(build_app(make, metrics)),
            host="127.0.0.1",
            port=port,
            log_config=None,
            access_log=False,
            lifespan="on",
        )
    )
    task = asyncio.create_task(server.serve())
    url = f"http://127.0.0.1:{port}"
    try:
        await asyncio.to_thread(wait_until, lambda: _ready(url), node, "node + in-process gateway", 120)
        auth = {"Authorization": f"Bearer {INTERNAL_KEY}"}
        async with httpx.AsyncClient() as c:
            engines = (await c.get(f"http://127.0.0.1:{node_port}/v1/engines", headers=auth)).json()[
                "engines"
            ]
        yield Gateway(url, held["svc"], engines[0]["model"], f"http://127.0.0.1:{node_port}")
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


_CONVERSATIONS: dict[tuple[int, str, str], Conversation] = {}


def _conversation(gw: Gateway, key: str, session: str) -> Conversation:
    """The conversation of `session` with `key` on `gw` (each turn goes on from the last: a turn that
    did not would branch, gateway.turn.branch)."""
    return _CONVERSATIONS.setdefault((id(gw), key, session), Conversation(gw, key, session, max_tokens=1))


async def _turn(c: httpx.AsyncClient, gw: Gateway, key: str, session: str, text: str) -> httpx.Response:
    return await _conversation(gw, key, session).turn(c, text)


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
        node = next(iter(svc.runner.parts.nodes.values()))
        real_spill = node.spill
        node.spill = slow_spill  # type: ignore[method-assign]
        try:
            await _turn(c, gateway, "key-durable", "busy-saver", "Turn two.")
            await asyncio.wait_for(saving.wait(), 10)  # its save is running (and stuck)
            # The next turns run on the live slot meanwhile: not forked, not waiting for the save,
            # taking the lock over from it (the opening read confirms it: still two round trips).
            for i in range(3):
                hold = svc.runner.parts.holds.get("durable", "busy-saver")
                assert hold is not None
                await asyncio.wait_for(hold.booked.wait(), 10)  # the previous turn's bookkeeping
                since = len(SENDS.log)
                resp = await asyncio.wait_for(
                    _turn(c, gateway, "key-durable", "busy-saver", f"Turn {i + 3}."), 10
                )
                assert resp.headers["x-session-id"] == "busy-saver"
                assert resp.headers["x-slotkeeper-cache"] == "live"
                assert svc.runner.parts.holds.get("durable", "busy-saver") is hold  # taken over
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


# -- early starts (gateway.turn.early) ----------------------------------------------------------------
def _early(svc: Services, outcome: str) -> int:
    value = svc.metrics.registry.get_sample_value(
        "slotkeeper_gateway_early_starts_total", {"outcome": outcome}
    )
    return int(value or 0)


@contextlib.asynccontextmanager
async def _saves_stuck(svc: Services) -> AsyncIterator[asyncio.Event]:
    """Every write-behind save hangs (holding the session's lock) until the block ends; yields an
    event set once a save is hanging."""
    gate, saving = asyncio.Event(), asyncio.Event()
    node = next(iter(svc.runner.parts.nodes.values()))
    real_spill = node.spill

    async def slow_spill(*args: Any, **kwargs: Any) -> Any:
        saving.set()
        await gate.wait()
        return await real_spill(*args, **kwargs)

    node.spill = slow_spill  # type: ignore[method-assign]
    try:
        yield saving
    finally:
        gate.set()
        node.spill = real_spill  # type: ignore[method-assign]
    await _settled(svc)


async def _held(svc: Services, tenant: str, session: str) -> None:
    """This gateway holds the session (its save hangs) and the last turn's bookkeeping is written."""
    hold = svc.runner.parts.holds.get(tenant, session)
    assert hold is not None
    await asyncio.wait_for(hold.booked.wait(), 10)


class Conversation:
    """An agent's conversation: every turn sends the whole history so far (it continues the slot)."""

    def __init__(self, gw: Gateway, key: str, session: str, max_tokens: int = 3) -> None:
        self.gw, self.key, self.session, self.max_tokens = gw, key, session, max_tokens
        self.messages: list[dict[str, Any]] = []
        self.headers = {"Authorization": f"Bearer {key}", "X-Session-Id": session}

    def body(self, text: str) -> dict[str, Any]:
        """The next turn's body: the history so far and `text`."""
        messages = [*self.messages, {"role": "user", "content": text}]
        return {**_body(self.gw.engine_model, text), "messages": messages, "max_tokens": self.max_tokens}

    async def turn(self, c: httpx.AsyncClient, text: str) -> httpx.Response:
        return await self._send(c, self.body(text))

    async def again(self, c: httpx.AsyncClient) -> httpx.Response:
        """The last turn sent again (a retry: the same prompt; its answer replaces the last one)."""
        return await self._send(c, {**self.body(""), "messages": self.messages[:-1]})

    async def _send(self, c: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
        resp = await c.post(self.gw.url + "/v1/chat/completions", json=body, headers=self.headers)
        assert resp.status_code == 200, resp.text
        self.messages = [*body["messages"], resp.json()["choices"][0]["message"]]
        return resp


async def test_a_turn_on_a_held_session_goes_to_its_slot_beside_its_opening_read(gateway: Gateway) -> None:
    svc = gateway.svc
    chat = Conversation(gateway, "key-durable", "early")
    async with httpx.AsyncClient(timeout=60) as c:
        await chat.turn(c, "Say hi.")
        await _settled(svc)  # the save released the lock: the next turn waits for its opening read
        await chat.turn(c, "Turn two.")
        assert _early(svc, "answered") == 0
        async with _saves_stuck(svc) as saving:
            await chat.turn(c, "Turn three.")
            await asyncio.wait_for(saving.wait(), 10)
            for i in range(3):
                await _held(svc, "durable", "early")
                since, answered = len(SENDS.log), _early(svc, "answered")
                resp = await chat.turn(c, f"Turn {i + 4}.")
                assert resp.headers["x-slotkeeper-cache"] == "live"
                assert resp.headers["x-session-id"] == "early"
                timings = resp.json()["timings"]
                # The live slot's state, as without an early start: only the new tokens evaluated.
                assert timings["cache_n"] > timings["prompt_n"] > 0
                assert _early(svc, "answered") == answered + 1
                await _held(svc, "durable", "early")
                assert len(SENDS.request_path(since)) <= 2  # the same two round trips
        assert (_early(svc, "abandoned"), _early(svc, "refused")) == (0, 0)
    rec = await svc.index.get("durable", "early")
    assert rec.state is SessionState.LIVE and not rec.dirty  # the newest state is durable


async def test_an_early_start_the_opening_read_refuses_is_abandoned(
    gateway: Gateway, redis_port: int
) -> None:
    svc = gateway.svc
    limited = svc.tenants.by_name["limited"]
    async with httpx.AsyncClient(timeout=60) as c:
        await _turn(c, gateway, "key-limited", "capped", "Say hi.")
        await _settled(svc)
        async with _saves_stuck(svc) as saving:
            await _turn(c, gateway, "key-limited", "capped", "Turn two.")
            await asyncio.wait_for(saving.wait(), 10)
            await _held(svc, "limited", "capped")
            # Other replicas used up the tenant's minute meanwhile: this process's last read said 2.
            window, _ = svc.index._window("limited", "rpm", 60)
            await svc.index._redis.set(window, limited.quotas.requests_per_minute)
            chat = _conversation(gateway, "key-limited", "capped")
            body, headers = chat.body("Turn three."), chat.headers
            for _ in range(2):
                resp = await c.post(gateway.url + "/v1/chat/completions", json=body, headers=headers)
                assert resp.status_code == 429, resp.text
            # The first was sent early and abandoned; after the refusal, no more early starts.
            assert (_early(svc, "abandoned"), _early(svc, "answered")) == (1, 0)
            await svc.index._redis.delete(window)  # (a new minute)
            resp = await _turn(c, gateway, "key-limited", "capped", "Turn four.")
            assert resp.headers["x-slotkeeper-cache"] == "live"
            assert _early(svc, "answered") == 0  # the tenant waits for its window to turn
    rec = await svc.index.get("limited", "capped")
    assert rec.state is SessionState.LIVE and rec.engine is not None


async def test_an_early_start_to_a_restarted_engine_process_is_refused_there_and_sent_again(
    gateway: Gateway,
) -> None:
    """The engine restarted at the same address and the gateway's registry cache has not seen it:
    the early call names the process it was meant for, the engine refuses it before any slot, and
    the turn is sent again as the ordinary call (what it would have done without an early start)."""
    svc = gateway.svc
    cluster = svc.runner.parts.cluster
    async with httpx.AsyncClient(timeout=60) as c:
        await _turn(c, gateway, "key-durable", "fenced", "Say hi.")
        await _settled(svc)
        async with _saves_stuck(svc) as saving:
            first = await _turn(c, gateway, "key-durable", "fenced", "Turn two.")
            await asyncio.wait_for(saving.wait(), 10)
            await _held(svc, "durable", "fenced")
            cache = cluster._cache
            assert cache is not None
            refs = {e: dataclasses.replace(r, instance="an-earlier-process") for e, r in cache.refs.items()}
            cluster._cache = dataclasses.replace(cache, refs=refs)
            resp = await _conversation(gateway, "key-durable", "fenced").again(c)
            assert (_early(svc, "refused"), _early(svc, "answered")) == (1, 0)
            assert resp.headers["x-slotkeeper-cache"] == "live"
            assert resp.json()["choices"] == first.json()["choices"]  # a retry of the same turn


async def test_an_engine_that_restarted_under_a_held_session_is_never_sent_the_early_call(
    gateway: Gateway,
) -> None:
    """SIGKILL of the engine while this gateway holds the session: the node restarts it (a new
    process, a new address) and drops the session from the index. The next turn's early call, if
    any, is abandoned: the opening read says the session is no longer live there, and the turn is
    served from its saved state or cold — never on the new process's slot as if it were live."""
    svc = gateway.svc
    async with httpx.AsyncClient(timeout=60) as c:
        await _turn(c, gateway, "key-durable", "crash", "Say hi.")
        await _settled(svc)
        before = (await svc.index.get("durable", "crash")).generation
        async with _saves_stuck(svc) as saving:
            await _turn(c, gateway, "key-durable", "crash", "Turn two.")
            await asyncio.wait_for(saving.wait(), 10)
            await _held(svc, "durable", "crash")
            auth = {"Authorization": f"Bearer {INTERNAL_KEY}"}
            (engine,) = (await c.get(gateway.node_url + "/v1/engines", headers=auth)).json()["engines"]
            old = engine["instance"]
            os.killpg(int(engine["pid"]), signal.SIGKILL)
            for _ in range(300):  # the node restarts it and drops its sessions from the index
                rec = await svc.index.get("durable", "crash")
                listed = await svc.runner.parts.cluster.registry.list()
                if rec.state is not SessionState.LIVE and listed and listed[0].instance not in ("", old):
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the engine was not restarted and its session dropped in 30 s")
            resp = await _turn(c, gateway, "key-durable", "crash", "Turn three.")
            assert resp.headers["x-slotkeeper-cache"] in ("restored", "cold")
            # Sent early to where the cache said (the old process's address): abandoned, not answered.
            assert (_early(svc, "abandoned"), _early(svc, "answered")) == (1, 0)
    rec = await svc.index.get("durable", "crash")
    assert rec.state is SessionState.LIVE and rec.generation >= before


async def test_a_chat_bodys_walk_from_its_route_to_the_engine_rarely_goes_back(gateway: Gateway) -> None:
    """A reader following a chat body through the turn's package goes back to a module it left at
    most three times (issue 46's measure): a turn of a session live in its slot, with no hold to
    take over (no early start: the whole path), from the chat route to the engine socket."""
    chat = Conversation(gateway, "key-lazy", "walked")
    async with httpx.AsyncClient(timeout=60) as c:
        await chat.turn(c, "Say hi.")
        await _settled(gateway.svc)  # every hold released: the next turn takes the whole path
        chat.headers[Walk.HEADER] = "1"
        WALK.start()
        sys.setprofile(WALK.profile)
        try:
            resp = await chat.turn(c, "Again.")
        finally:
            sys.setprofile(None)
    assert resp.headers["x-slotkeeper-cache"] == "live" and WALK.done, WALK.modules
    print(f"\nwalk: {' -> '.join(m.removeprefix('gateway.') for m in WALK.modules)}; returns: {WALK.returns}")
    assert WALK.returns <= 3, WALK.modules

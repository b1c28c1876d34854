"""Two node agents in the test's process, each supervising real engine processes — n1 a prefill
engine, n2 a decode engine of one model — with n1's node API served on loopback with the internal
credential, as a node serves it (tests of engine_pool.pool.handoff_peer and handoff_store).
`node_pairs(tmp_path)` yields `start(prefill_model, decode_model, ctx, store)`, which starts a
`Pair` (`store`: both nodes' blob store, None: none)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from engine_pool.http.credentials import auth_headers
from engine_pool.pool.agent import NodeAgent, NodeParts
from engine_pool.pool.routes import build_node_app
from engine_pool.pool.settings import NodeSettings
from engine_pool.pool.supervisor import State
from engine_pool.protocol.handoff import HandoffRequest
from gateway.bench.harness.servers import INTERNAL_KEY, free_port

MESSAGES = [
    {"role": "system", "content": "You are a careful assistant. Answer briefly and exactly. " * 6},
    {"role": "user", "content": "Tell me about the weather, the time and the place of the meeting."},
]
BODY = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0}


class Pair:
    """n1 (a prefill engine, its node API at ``url``) and n2 (a decode engine)."""

    def __init__(self, prefill: NodeAgent, decode: NodeAgent, url: str) -> None:
        self.prefill, self.decode, self.url = prefill, decode, url
        self.prefill_engine = next(iter(prefill.engines))
        self.decode_engine = next(iter(decode.engines))

    def request(
        self, session: str, messages: list[dict[str, Any]] | None = None, **kw: Any
    ) -> HandoffRequest:
        body = handoff_body(session, messages)
        return HandoffRequest("t1", session, self.prefill_engine, body, prefill_node=self.url, **kw)

    async def handoff(self, session: str, slot: int = 0, **kw: Any) -> Any:
        return await self.decode.handoff(self.decode_engine, str(slot), self.request(session, **kw))

    async def chat(
        self, slot: int, session: str, served: str = "cold", messages: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """The turn on the decode engine's ``slot``, as the gateway sends it."""
        url = self.decode.engines[self.decode_engine].url
        assert url is not None
        return await chat(self.decode, url, turn_body(slot, session, served, messages))

    async def slot_tokens(self, slot: int) -> int:
        url = self.decode.engines[self.decode_engine].url
        return int((await self.decode.parts.http.get(f"{url}/slots")).json()[slot]["n_tokens"])

    def leftovers(self) -> list[Path]:
        agents = (self.prefill, self.decode)
        return [f for a in agents for sup in a.engines.values() for f in sup.spec.slot_dir.iterdir()]


def handoff_body(session: str, messages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The body of a handoff of tenant t1's ``session`` (``messages``: else the default turn's)."""
    body = {**BODY, "model": "m", "cache_prompt": True, "slot_owner": "t1", "slot_session": session}
    if messages is not None:
        body["messages"] = messages
    return body


def turn_body(
    slot: int, session: str, served: str = "cold", messages: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A turn of tenant t1's ``session`` on ``slot`` as the gateway sends it to an engine."""
    return {
        **BODY,
        "messages": messages or MESSAGES,
        "id_slot": slot,
        "slot_owner": "t1",
        "slot_session": session,
        "slotkeeper": {"served": served},
    }


async def chat(agent: NodeAgent, engine_url: str, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` as a chat completion on the engine at ``engine_url``, through ``agent``'s client."""
    r = await agent.parts.http.post(f"{engine_url}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def start_agent(settings: NodeSettings, store: Any, closers: list[Callable[[], Any]]) -> NodeAgent:
    """A node agent of ``settings`` in this process (no spill cache, index or registry), its
    engines starting; its client's closer added to ``closers`` (the caller closes the agent)."""
    http = httpx.AsyncClient(timeout=60, headers=auth_headers(INTERNAL_KEY))
    closers.append(http.aclose)
    parts = NodeParts(store=store, cache=None, index=None, registry=None, http=http)  # type: ignore[arg-type]
    agent = NodeAgent(settings, parts, settings.engine_specs(os.environ))
    for sup in agent.engines.values():
        sup.spec.slot_dir.mkdir(parents=True, exist_ok=True)
        agent._tasks.append(asyncio.create_task(sup.run()))
        sup.start()
    return agent


def text(answer: dict[str, Any]) -> str:
    """A chat answer's text."""
    return str(answer["choices"][0]["message"]["content"])


def count(metric: Any, result: str) -> float:
    """A labelled counter's value (a node's metrics, by result)."""
    return float(metric.labels(result)._value.get())


async def until(probe: Callable[[], Any], within_s: float) -> None:
    """Poll ``probe`` (a coroutine function) until it is true, for at most ``within_s``."""
    async with asyncio.timeout(within_s):
        while True:
            if await probe():
                return
            await asyncio.sleep(0.02)


@asynccontextmanager
async def node_pairs(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """`await start(prefill_model, decode_model, ctx, store)`: the two nodes, each engine 2 slots;
    everything started is stopped at the end."""
    agents: list[NodeAgent] = []
    closers: list[Callable[[], Any]] = []

    async def agent_of(name: str, model: str, role: str, ctx: int, store: Any) -> NodeAgent:
        settings = NodeSettings(
            models=(model,),
            aliases=("m",),
            roles=(role,),
            node_id=name,
            n_slots=2,
            ctx_per_slot=ctx,
            data_dir=str(tmp_path / name),
            engine_args=("-t", "1"),
            internal_key=INTERNAL_KEY,
        )
        agent = start_agent(settings, store, closers)
        agents.append(agent)
        return agent

    async def start(prefill_model: str, decode_model: str, ctx: int = 1024, store: Any = None) -> Pair:
        prefill = await agent_of("n1", prefill_model, "prefill", ctx, store)
        decode = await agent_of("n2", decode_model, "decode", ctx, store)

        @asynccontextmanager
        async def lifespan(app: Any) -> AsyncIterator[None]:
            app.state.agent = prefill
            yield

        port = free_port()
        config = uvicorn.Config(
            build_node_app(lifespan, INTERNAL_KEY), host="127.0.0.1", port=port, log_level="warning"
        )
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())

        async def stop_server() -> None:
            server.should_exit = True
            await task

        closers.append(stop_server)

        async def ready() -> bool:
            engines = [sup for a in (prefill, decode) for sup in a.engines.values()]
            if any(sup.state is State.FAILED for sup in engines):
                raise AssertionError([sup.snapshot().error for sup in engines])
            return server.started and all(sup.state is State.READY for sup in engines)

        await until(ready, 90)
        return Pair(prefill, decode, f"http://127.0.0.1:{port}")

    try:
        yield start
    finally:
        for agent in agents:
            await agent.close()
        for close in reversed(closers):
            await close()

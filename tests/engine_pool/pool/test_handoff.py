"""Handoffs on one node (engine_pool.pool.handoff): a node agent in this process supervising real
engine processes, a prefill and a decode engine of one model.

The strong way: the decode engine's turn after a handoff evaluates 0 prompt tokens (`last-token`:
1) and its greedy text is the one a turn that never left the decode engine gives; a state the decode
engine must refuse (another model's, damaged in flight) leaves its slot empty, and a prefill engine
with no free slot answers 503 at once — each counted by result.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_pool.errors import ApiError, Unavailable
from engine_pool.http.credentials import auth_headers
from engine_pool.pool import handoff as handoff_module
from engine_pool.pool.agent import NodeAgent, NodeParts
from engine_pool.pool.settings import NodeSettings
from engine_pool.pool.supervisor import State
from engine_pool.protocol.handoff import HandoffRequest
from gateway.bench.harness.servers import INTERNAL_KEY

MESSAGES = [
    {"role": "system", "content": "You are a careful assistant. Answer briefly and exactly. " * 6},
    {"role": "user", "content": "Tell me about the weather, the time and the place of the meeting."},
]
BODY = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0}


async def _ready(agent: NodeAgent) -> None:
    async with asyncio.timeout(90):
        while not all(sup.state is State.READY for sup in agent.engines.values()):
            if any(sup.state is State.FAILED for sup in agent.engines.values()):
                raise AssertionError({e: s.snapshot().error for e, s in agent.engines.items()})
            await asyncio.sleep(0.05)


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """`await node(prefill_model, decode_model)`: an agent with a prefill engine (e0) and a decode
    engine (e1) serving them under one model id, 2 slots each."""
    agents: list[NodeAgent] = []
    clients: list[httpx.AsyncClient] = []

    async def start(prefill_model: str, decode_model: str) -> NodeAgent:
        settings = NodeSettings(
            models=(prefill_model, decode_model),
            aliases=("m", "m"),
            roles=("prefill", "decode"),
            node_id="n1",
            n_slots=2,
            ctx_per_slot=1024,
            data_dir=str(tmp_path / f"node{len(agents)}"),
            engine_args=("-t", "1"),
            internal_key=INTERNAL_KEY,
        )
        http = httpx.AsyncClient(timeout=60, headers=auth_headers(INTERNAL_KEY))
        clients.append(http)
        parts = NodeParts(store=None, cache=None, index=None, registry=None, http=http)  # type: ignore[arg-type]
        agent = NodeAgent(settings, parts, settings.engine_specs(os.environ))
        agents.append(agent)
        for sup in agent.engines.values():
            sup.spec.slot_dir.mkdir(parents=True, exist_ok=True)
            agent._tasks.append(asyncio.create_task(sup.run()))
            sup.start()
        await _ready(agent)
        return agent

    yield start
    for agent in agents:
        await agent.close()
    for http in clients:
        await http.aclose()


def _engines(agent: NodeAgent) -> tuple[str, str]:
    prefill, decode = (sup.spec.engine_id for sup in agent.engines.values())
    return prefill, decode


def _url(agent: NodeAgent, engine: str) -> str:
    url = agent.engines[engine].url
    assert url is not None
    return url


def _request(agent: NodeAgent, session: str, mode: str = "logits") -> HandoffRequest:
    prefill, _ = _engines(agent)
    body = {**BODY, "model": "m", "cache_prompt": True, "slot_owner": "t1", "slot_session": session}
    return HandoffRequest("t1", session, prefill, body, mode=mode)


async def _chat(agent: NodeAgent, slot: int, session: str, served: str = "cold") -> dict[str, Any]:
    """The turn on the decode engine's ``slot``, as the gateway sends it."""
    _, decode = _engines(agent)
    body = {
        **BODY,
        "id_slot": slot,
        "slot_owner": "t1",
        "slot_session": session,
        "slotkeeper": {"served": served},
        "prefix_slots": [],  # (the gateway names them: none here)
    }
    r = await agent.parts.http.post(f"{_url(agent, decode)}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


async def _slot_tokens(agent: NodeAgent, engine: str, slot: int) -> int:
    r = await agent.parts.http.get(f"{_url(agent, engine)}/slots")
    return int(r.json()[slot]["n_tokens"])


def _text(answer: dict[str, Any]) -> str:
    return str(answer["choices"][0]["message"]["content"])


@pytest.mark.parametrize("arch", ["qwen35", "gemma2", "llama"])
async def test_the_decode_side_evaluates_no_prompt_token_and_answers_as_unsplit(
    node: Callable[..., Any], tiny_model: Callable[..., str], arch: str
) -> None:
    model = tiny_model(arch)
    agent = await node(model, model)
    _, decode = _engines(agent)
    unsplit = await _chat(agent, 1, "s-whole")  # a turn that never left the decode engine
    n_prompt = unsplit["timings"]["prompt_n"]
    assert n_prompt > 100

    out = await agent.handoff(decode, "0", _request(agent, "s-split"))
    assert out.prompt_n == n_prompt and out.tokens == n_prompt and out.bytes > 0
    assert out.mode == "logits" and out.ms >= out.prefill_ms
    split = await _chat(agent, 0, "s-split", served="handoff")
    assert split["timings"]["prompt_n"] == 0  # the first token sampled from the handed logits
    assert split["timings"]["cache_n"] == n_prompt
    assert split["slotkeeper"]["served"] == "handoff"
    assert _text(split) == _text(unsplit) and _text(split)
    done = agent.metrics.handoffs.labels("done")._value.get()  # type: ignore[attr-defined]
    assert done == 1


async def test_last_token_hands_over_all_but_the_last_token(
    node: Callable[..., Any], tiny_model: Callable[..., str]
) -> None:
    model = tiny_model("qwen35")
    agent = await node(model, model)
    _, decode = _engines(agent)
    unsplit = await _chat(agent, 1, "s-whole")
    n_prompt = unsplit["timings"]["prompt_n"]
    out = await agent.handoff(decode, "0", _request(agent, "s-split", mode="last-token"))
    assert out.mode == "last-token" and out.prompt_n == n_prompt - 1 and out.tokens == n_prompt - 1
    split = await _chat(agent, 0, "s-split", served="handoff")
    assert split["timings"]["prompt_n"] == 1  # the decode side evaluates the last prompt token
    assert _text(split) == _text(unsplit)


async def test_a_state_damaged_in_flight_is_refused_and_leaves_the_slot_empty(
    node: Callable[..., Any], tiny_model: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model("qwen35")
    agent = await node(model, model)
    _, decode = _engines(agent)
    move = handoff_module._move

    def damaged(src: Path, dest: Path) -> None:
        move(src, dest)
        data = bytearray(dest.read_bytes())
        data[len(data) // 2] ^= 0xFF
        dest.unlink()  # (a hard link shares the prefill side's bytes: damage a copy of its own)
        dest.write_bytes(bytes(data))

    monkeypatch.setattr(handoff_module, "_move", damaged)
    with pytest.raises(ApiError) as err:
        await agent.handoff(decode, "0", _request(agent, "s1"))
    assert err.value.status == 400 and err.value.extra.get("kind") == "checksum_mismatch"
    assert await _slot_tokens(agent, decode, 0) == 0
    assert agent.metrics.handoffs.labels("refused")._value.get() == 1  # type: ignore[attr-defined]
    monkeypatch.setattr(handoff_module, "_move", move)
    # The turn then runs unsplit on the empty slot: a clean prefill.
    answer = await _chat(agent, 0, "s1")
    assert answer["timings"]["prompt_n"] == answer["usage"]["prompt_tokens"]
    assert not list(agent.engines[decode].spec.slot_dir.iterdir())  # nothing left behind


async def test_another_models_state_is_refused(
    node: Callable[..., Any], tiny_model: Callable[..., str]
) -> None:
    agent = await node(tiny_model("qwen35", seed=1), tiny_model("qwen35"))
    _, decode = _engines(agent)
    with pytest.raises(ApiError) as err:
        await agent.handoff(decode, "0", _request(agent, "s1"))
    assert err.value.extra.get("kind") == "model_mismatch"
    assert await _slot_tokens(agent, decode, 0) == 0


async def test_a_prefill_engine_without_a_free_slot_answers_at_once(
    node: Callable[..., Any], tiny_model: Callable[..., str]
) -> None:
    model = tiny_model("qwen35")
    agent = await node(model, model)
    prefill, decode = _engines(agent)
    lent = [await agent.prefill_slots.lend(prefill, 1) for _ in range(2)]  # both slots busy
    request = HandoffRequest("t1", "s1", prefill, _request(agent, "s1").body, wait_s=0.05)
    with pytest.raises(Unavailable):
        await agent.handoff(decode, "0", request)
    assert agent.metrics.handoffs.labels("unavailable")._value.get() == 1  # type: ignore[attr-defined]
    for slot in lent:
        agent.prefill_slots.give_back(prefill, slot)
    # A decode engine is no prefill engine, and turns never hand off to one.
    with pytest.raises(ApiError) as err:
        await agent.handoff(prefill, "0", HandoffRequest("t1", "s1", decode, request.body))
    assert err.value.status == 400

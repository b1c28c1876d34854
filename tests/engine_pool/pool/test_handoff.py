"""Handoffs on one node (engine_pool.pool.handoff): a node agent in this process supervising real
engine processes, a prefill and a decode engine of one model.

The strong way: the decode engine's turn after a handoff evaluates 0 prompt tokens (`last-token`:
1) and its greedy text is the one a turn that never left the decode engine gives — a new session's,
and a live session's long new tail, its state carried to the prefill slot first; a state the decode
engine must refuse (another model's, damaged in flight) leaves its slot empty (a carried session's
own state put back), a prefill engine with no free slot answers 503 at once, a hung one within the
request's bound, a caller that leaves cancels the prefill where it runs, and a decode engine killed
mid-install fails the handoff at once — each counted by result, no file left behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from support.node_pair import MESSAGES, chat, handoff_body, start_agent, text, turn_body, until

from engine_pool.errors import ApiError, Unavailable
from engine_pool.pool import handoff as handoff_module
from engine_pool.pool.agent import NodeAgent
from engine_pool.pool.settings import NodeSettings
from engine_pool.pool.supervisor import State
from engine_pool.protocol.handoff import HandoffRequest
from gateway.bench.harness.servers import INTERNAL_KEY


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
    closers: list[Callable[[], Any]] = []

    async def start(prefill_model: str, decode_model: str, ctx: int = 1024) -> NodeAgent:
        settings = NodeSettings(
            models=(prefill_model, decode_model),
            aliases=("m", "m"),
            roles=("prefill", "decode"),
            node_id="n1",
            n_slots=2,
            ctx_per_slot=ctx,
            data_dir=str(tmp_path / f"node{len(agents)}"),
            engine_args=("-t", "1"),
            internal_key=INTERNAL_KEY,
        )
        agent = start_agent(settings, None, closers)
        agents.append(agent)
        await _ready(agent)
        return agent

    yield start
    for agent in agents:
        await agent.close()
    for close in closers:
        await close()


def _engines(agent: NodeAgent) -> tuple[str, str]:
    prefill, decode = (sup.spec.engine_id for sup in agent.engines.values())
    return prefill, decode


def _url(agent: NodeAgent, engine: str) -> str:
    url = agent.engines[engine].url
    assert url is not None
    return url


def _request(
    agent: NodeAgent,
    session: str,
    mode: str = "logits",
    messages: list[dict[str, Any]] | None = None,
    **kw: Any,
) -> HandoffRequest:
    prefill, _ = _engines(agent)
    return HandoffRequest("t1", session, prefill, handoff_body(session, messages), mode=mode, **kw)


async def _chat(
    agent: NodeAgent,
    slot: int,
    session: str,
    served: str = "cold",
    messages: list[dict[str, Any]] | None = None,
    prefix_slots: tuple[int, ...] = (),
) -> dict[str, Any]:
    """The turn on the decode engine's ``slot``, as the gateway sends it (``prefix_slots``: the
    tenant's other slots there, which its prompt may start from)."""
    _, decode = _engines(agent)
    body = {**turn_body(slot, session, served, messages), "prefix_slots": list(prefix_slots)}
    return await chat(agent, _url(agent, decode), body)


async def _slot_tokens(agent: NodeAgent, engine: str, slot: int) -> int:
    r = await agent.parts.http.get(f"{_url(agent, engine)}/slots")
    return int(r.json()[slot]["n_tokens"])


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
    assert text(split) == text(unsplit) and text(split)
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
    assert text(split) == text(unsplit)


async def test_a_state_damaged_in_flight_is_refused_and_leaves_the_slot_empty(
    node: Callable[..., Any], tiny_model: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model("qwen35")
    agent = await node(model, model)
    _, decode = _engines(agent)
    move = handoff_module.link_or_copy

    def damaged(src: Path, dest: Path) -> None:
        move(src, dest)
        data = bytearray(dest.read_bytes())
        data[len(data) // 2] ^= 0xFF
        dest.unlink()  # (a hard link shares the prefill side's bytes: damage a copy of its own)
        dest.write_bytes(bytes(data))

    monkeypatch.setattr(handoff_module, "link_or_copy", damaged)
    with pytest.raises(ApiError) as err:
        await agent.handoff(decode, "0", _request(agent, "s1"))
    assert err.value.status == 400 and err.value.extra.get("kind") == "checksum_mismatch"
    assert await _slot_tokens(agent, decode, 0) == 0
    assert agent.metrics.handoffs.labels("refused")._value.get() == 1  # type: ignore[attr-defined]
    monkeypatch.setattr(handoff_module, "link_or_copy", move)
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


def _tool_output(n: int) -> str:
    """A long tool result: distinct lines, so that nothing in it repeats a token run."""
    return "\n".join(
        f"row {i}: sensor {i % 17} read {i * 7 % 101} at {i % 24:02d}:{i % 60:02d}" for i in range(n)
    )


def _next_turn(first: dict[str, Any], tail: str) -> list[dict[str, Any]]:
    """The conversation after the first turn's answer, with a long new message."""
    return [
        *MESSAGES,
        {"role": "assistant", "content": text(first)},
        {"role": "user", "content": "Here is the tool's output:\n" + tail + "\nWhat stands out?"},
    ]


def _leftovers(agent: NodeAgent) -> list[Path]:
    return [f for sup in agent.engines.values() for f in sup.spec.slot_dir.iterdir()]


@pytest.mark.parametrize("arch", ["qwen35", "gemma2", "llama"])
async def test_a_live_sessions_long_tail_is_prefilled_on_the_prefill_engine(
    node: Callable[..., Any], tiny_model: Callable[..., str], arch: str
) -> None:
    """The turns agents send: a session live in its decode slot, a long tool output as its next
    message. Its state goes to the prefill slot, which evaluates only the new tail; the decode side
    evaluates nothing and answers as the same session kept unsplit in another slot."""
    model = tiny_model(arch)
    agent = await node(model, model, 4096)
    _, decode = _engines(agent)
    first = await _chat(agent, 1, "s-whole")  # the same session twice: one stays unsplit
    assert text(await _chat(agent, 0, "s-split")) == text(first)
    messages = _next_turn(first, _tool_output(60))
    whole = await _chat(agent, 1, "s-whole", served="live", messages=messages)
    n_prompt, tail = whole["usage"]["prompt_tokens"], whole["timings"]["prompt_n"]
    assert tail > 1000 and whole["timings"]["cache_n"] > 100  # a live turn: only its tail evaluated

    out = await agent.handoff(decode, "0", _request(agent, "s-split", messages=messages, carry=True))
    assert out.carried_bytes > 0 and out.tokens == n_prompt
    # The prefill engine evaluated the tail the decode engine would have (a carried state is a
    # restored one: on a sliding window only the window comes back, so a prompt that leaves the
    # state a few tokens before its end rolls back to the checkpoint there instead of trimming).
    assert tail <= out.prompt_n <= tail + 64
    split = await _chat(agent, 0, "s-split", served="handoff", messages=messages)
    assert split["timings"]["prompt_n"] == 0 and split["timings"]["cache_n"] == n_prompt
    assert text(split) == text(whole) and text(split)
    assert not _leftovers(agent)


async def test_a_forks_slot_is_carried_from_its_parents_state(
    node: Callable[..., Any], tiny_model: Callable[..., str]
) -> None:
    """A fork's slot holds its parent's state, labelled with the parent: carried only as that
    (`carry_from`), installed as the fork's own."""
    model = tiny_model("qwen35")
    agent = await node(model, model, 4096)
    _, decode = _engines(agent)
    first = await _chat(agent, 0, "parent")
    assert text(await _chat(agent, 1, "s-whole")) == text(first)
    messages = _next_turn(first, _tool_output(30))
    whole = await _chat(agent, 1, "s-whole", served="live", messages=messages)
    # Without `carry_from` the slot's label (the parent) is not the turn's session: refused, kept.
    with pytest.raises(ApiError) as err:
        await agent.handoff(decode, "0", _request(agent, "fork", messages=messages, carry=True))
    assert err.value.status == 409
    out = await agent.handoff(
        decode, "0", _request(agent, "fork", messages=messages, carry=True, carry_from="parent")
    )
    assert out.carried_bytes > 0 and out.tokens == whole["usage"]["prompt_tokens"]
    split = await _chat(agent, 0, "fork", served="handoff", messages=messages)
    assert split["timings"]["prompt_n"] == 0
    assert text(split) == text(whole)
    assert not _leftovers(agent)


async def test_a_carried_session_keeps_its_state_when_the_install_is_refused(
    node: Callable[..., Any], tiny_model: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model("qwen35")
    agent = await node(model, model, 4096)
    _, decode = _engines(agent)
    first = await _chat(agent, 0, "s1")
    held = await _slot_tokens(agent, decode, 0)
    move = handoff_module.link_or_copy

    def damaged(src: Path, dest: Path) -> None:
        move(src, dest)
        if dest.name.startswith("handoff-"):  # (the carried file passes; the handed one is damaged)
            data = bytearray(dest.read_bytes())
            data[len(data) // 3] ^= 0x5A
            dest.unlink()
            dest.write_bytes(bytes(data))

    monkeypatch.setattr(handoff_module, "link_or_copy", damaged)
    messages = _next_turn(first, _tool_output(20))
    with pytest.raises(ApiError) as err:
        await agent.handoff(decode, "0", _request(agent, "s1", messages=messages, carry=True))
    assert err.value.extra.get("kind") == "checksum_mismatch"
    assert agent.metrics.handoffs.labels("refused")._value.get() == 1  # type: ignore[attr-defined]
    # The session's own state is back in its slot, labelled: the turn runs there live, unsplit.
    assert await _slot_tokens(agent, decode, 0) == held
    live = await _chat(agent, 0, "s1", served="live", messages=messages)
    assert live["timings"]["cache_n"] >= held - 20 and live["timings"]["prompt_n"] > 300
    assert not _leftovers(agent)


async def test_a_hung_prefill_engine_costs_its_bound_then_works_again(
    node: Callable[..., Any], tiny_model: Callable[..., str]
) -> None:
    model = tiny_model("qwen35")
    agent = await node(model, model)
    prefill, decode = _engines(agent)
    pid = agent.engines[prefill].snapshot().pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # alive, answering nothing
    try:
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match="longer than 0.5 s"):
            await agent.handoff(decode, "0", _request(agent, "s1", timeout_s=0.5))
        assert time.monotonic() - t0 < 5
    finally:
        os.kill(pid, signal.SIGCONT)
    assert agent.metrics.handoffs.labels("unavailable")._value.get() == 1  # type: ignore[attr-defined]
    assert await _slot_tokens(agent, decode, 0) == 0
    out = await agent.handoff(decode, "0", _request(agent, "s1"))
    assert out.tokens > 100
    assert not _leftovers(agent)


async def test_a_caller_that_leaves_cancels_the_prefill_where_it_runs(
    node: Callable[..., Any], tiny_model: Callable[..., str]
) -> None:
    model = tiny_model("qwen35")
    agent = await node(model, model, 8192)
    prefill, decode = _engines(agent)
    long = [*MESSAGES[:1], {"role": "user", "content": _tool_output(250)}]  # seconds of prefill
    task = asyncio.create_task(agent.handoff(decode, "0", _request(agent, "s1", messages=long)))
    http, url = agent.parts.http, _url(agent, prefill)

    async def processing() -> bool:
        return any(s["is_processing"] for s in (await http.get(f"{url}/slots")).json())

    await until(processing, 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    async def idle() -> bool:
        return not await processing()

    await until(idle, 10)  # the engine saw its client go and stopped at its next batch
    assert agent.metrics.handoffs.labels("cancelled")._value.get() == 1  # type: ignore[attr-defined]
    assert await _slot_tokens(agent, decode, 0) == 0
    assert not _leftovers(agent)


async def test_a_decode_engine_killed_mid_install_fails_the_handoff_at_once(
    node: Callable[..., Any], tiny_model: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model("qwen35")
    agent = await node(model, model)
    _, decode = _engines(agent)
    pid = agent.engines[decode].snapshot().pid
    assert pid is not None
    move = handoff_module.link_or_copy

    def killing(src: Path, dest: Path) -> None:
        os.kill(pid, signal.SIGKILL)  # the install's restore then finds the engine gone
        move(src, dest)

    monkeypatch.setattr(handoff_module, "link_or_copy", killing)
    t0 = time.monotonic()
    with pytest.raises(ApiError):
        await agent.handoff(decode, "0", _request(agent, "s1"))
    assert time.monotonic() - t0 < 10
    failed = (agent.metrics.handoffs.labels(r)._value.get() for r in ("failed", "unavailable"))  # type: ignore[attr-defined]
    assert sum(failed) == 1  # (connection refused, or 503 from an engine going down)
    monkeypatch.setattr(handoff_module, "link_or_copy", move)
    # Its supervisor restarts it; the next handoff to it works.

    async def restarted() -> bool:
        sup = agent.engines[decode]
        return sup.state is State.READY and sup.snapshot().pid not in (None, pid)

    await until(restarted, 60)
    out = await agent.handoff(decode, "0", _request(agent, "s2"))
    split = await _chat(agent, 0, "s2", served="handoff")
    assert out.tokens > 100 and split["timings"]["prompt_n"] == 0
    assert not _leftovers(agent)


@pytest.mark.parametrize("mode", ["last-token", "logits"])
async def test_sessions_of_one_long_prompt_on_a_sliding_window_model_go_on(
    node: Callable[..., Any], tiny_model: Callable[..., str], mode: str
) -> None:
    """gemma2 (a 32-token window): sessions of one prompt longer than the window cache, handed off
    and started from each other's slots (the gateway names the tenant's other slots), each go on
    with a next turn. A session started from another's slot shared its window cells, which llama.cpp
    never reuses while two sequences hold them: the next llama_decode of either failed (code 1)."""
    model = tiny_model("gemma2")
    agent = await node(model, model, 4096)
    _, decode = _engines(agent)
    messages = [*MESSAGES[:1], {"role": "user", "content": _tool_output(40)}]
    unsplit = await _chat(agent, 1, "s-whole", messages=messages)
    assert unsplit["usage"]["prompt_tokens"] > 800  # past the window cache (32 * 2 + 512 -> 768 cells)
    out = await agent.handoff(decode, "0", _request(agent, "s-a", mode=mode, messages=messages))
    split = await _chat(agent, 0, "s-a", "handoff", messages=messages, prefix_slots=(1,))
    assert split["timings"]["prompt_n"] == (1 if mode == "last-token" else 0) and out.tokens > 800
    assert text(split) == text(unsplit)
    # Another session of the prompt, in slot 1: started from slot 0's state.
    twin = await _chat(agent, 1, "s-b", messages=messages, prefix_slots=(0,))
    assert twin["timings"]["prompt_n"] == 0 and text(twin) == text(unsplit)
    for slot, session in ((1, "s-b"), (0, "s-a")):  # each goes on from its own state
        more = [
            *messages,
            {"role": "assistant", "content": text(unsplit)},
            {"role": "user", "content": "And?"},
        ]
        nxt = await _chat(agent, slot, session, "live", messages=more, prefix_slots=(1 - slot,))
        assert 0 < nxt["timings"]["prompt_n"] < 40

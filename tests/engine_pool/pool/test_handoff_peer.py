"""Handoffs node to node (engine_pool.pool.handoff_peer): two node agents in this process, each
supervising real engine processes — n1 a prefill engine, n2 a decode engine of one model — and
n1's node API served on loopback with the internal credential, as a node serves it
(support.node_pair).

The strong way: the decode engine's turn after a handoff from the other node evaluates 0 prompt
tokens and answers as a turn that never left the decode engine — a new session's, and a live
session's long new tail, its state carried to the other node and back; a state damaged on the way
is refused (the slot left empty, or the carried session's own state put back), a peer that breaks
off mid-file or cannot be reached fails the handoff at once, a caller that leaves cancels the
prefill on the peer; nothing is left behind on either node. The peer's route refuses what a caller
without the credential, or with a malformed frame, sends.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.node_pair import MESSAGES, count, node_pairs, until

from engine_pool.errors import ApiError, Upstream
from engine_pool.pool import handoff_peer
from engine_pool.protocol.handoff import HANDOFF_MEDIA, HandoffRequest, prefill_path
from gateway.bench.harness.servers import free_port


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    async with node_pairs(tmp_path) as start:
        yield start


def _tool_output(n: int) -> str:
    return "\n".join(
        f"row {i}: sensor {i % 17} read {i * 7 % 101} at {i % 24:02d}:{i % 60:02d}" for i in range(n)
    )


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _text(answer: dict[str, Any]) -> str:
    return str(answer["choices"][0]["message"]["content"])


@pytest.mark.parametrize("arch", ["qwen35", "gemma2", "llama"])
async def test_a_prefill_on_another_node_hands_its_state_and_logits_over(
    pair: Callable[..., Any], tiny_model: Callable[..., str], arch: str
) -> None:
    model = tiny_model(arch)
    p = await pair(model, model)
    unsplit = await p.chat(1, "s-whole")  # a turn that never left the decode engine
    n_prompt = unsplit["timings"]["prompt_n"]
    assert n_prompt > 100

    out = await p.handoff("s-split")
    assert out.prefill_node == p.url and out.prefill_engine == p.prefill_engine
    assert out.prompt_n == n_prompt == out.tokens and out.bytes > 0
    split = await p.chat(0, "s-split", served="handoff")
    assert split["timings"]["prompt_n"] == 0  # the first token sampled from the handed logits
    assert split["timings"]["cache_n"] == n_prompt
    assert _text(split) == _text(unsplit) and _text(split)
    assert count(p.decode.metrics.handoffs, "done") == 1
    assert count(p.prefill.metrics.peer_prefills, "done") == 1
    assert not p.leftovers()


async def test_a_live_sessions_long_tail_is_carried_to_the_other_node_and_back(
    pair: Callable[..., Any], tiny_model: Callable[..., str]
) -> None:
    model = tiny_model("qwen35")
    p = await pair(model, model, 4096)
    first = await p.chat(1, "s-whole")  # the same session twice: one stays unsplit
    assert _text(await p.chat(0, "s-split")) == _text(first)
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": _text(first)},
        {"role": "user", "content": "The tool's output:\n" + _tool_output(60) + "\nWhat stands out?"},
    ]
    whole = await p.chat(1, "s-whole", served="live", messages=messages)
    n_prompt, tail = whole["usage"]["prompt_tokens"], whole["timings"]["prompt_n"]
    assert tail > 1000 and whole["timings"]["cache_n"] > 100

    out = await p.handoff("s-split", messages=messages, carry=True)
    assert out.carried_bytes > 0 and out.tokens == n_prompt
    assert tail <= out.prompt_n <= tail + 64  # only the new tail evaluated on the other node
    split = await p.chat(0, "s-split", served="handoff", messages=messages)
    assert split["timings"]["prompt_n"] == 0 and split["timings"]["cache_n"] == n_prompt
    assert _text(split) == _text(whole) and _text(split)
    assert not p.leftovers()


async def test_a_state_damaged_on_the_way_is_refused_and_a_carried_session_keeps_its_own(
    pair: Callable[..., Any], tiny_model: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model("qwen35")
    p = await pair(model, model, 4096)
    write = handoff_peer.write_file

    async def damaged(chunks: AsyncIterator[bytes], dest: Path, limit: int) -> int:
        n = await write(chunks, dest, limit)
        if dest.parent == p.decode.engines[p.decode_engine].spec.slot_dir:  # (the handed file)
            await asyncio.to_thread(_flip, dest)
        return n

    monkeypatch.setattr(handoff_peer, "write_file", damaged)
    with pytest.raises(ApiError) as err:
        await p.handoff("s1")
    assert err.value.status == 400 and err.value.extra.get("kind") == "checksum_mismatch"
    assert await p.slot_tokens(0) == 0
    assert count(p.decode.metrics.handoffs, "refused") == 1

    # A live session: its own state is put back, and its turn runs there, unsplit.
    first = await p.chat(1, "s2")
    held = await p.slot_tokens(1)
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": _text(first)},
        {"role": "user", "content": "More?"},
    ]
    with pytest.raises(ApiError):
        await p.handoff("s2", slot=1, messages=messages, carry=True)
    assert await p.slot_tokens(1) == held
    live = await p.chat(1, "s2", served="live", messages=messages)
    assert live["timings"]["cache_n"] >= held - 20
    assert not p.leftovers()


async def test_a_peer_that_breaks_off_or_cannot_be_reached_fails_the_handoff_at_once(
    pair: Callable[..., Any], tiny_model: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model("qwen35")
    p = await pair(model, model)
    frames = handoff_peer._frames

    async def half(done: Any, fh: Any) -> AsyncIterator[bytes]:
        chunks = frames(done, fh)
        yield await anext(chunks)  # the JSON line
        yield (await anext(chunks))[: done.bytes // 2]  # and the connection ends mid-file

    monkeypatch.setattr(handoff_peer, "_frames", half)
    with pytest.raises(Upstream, match="broke off"):
        await p.handoff("s1")
    monkeypatch.setattr(handoff_peer, "_frames", frames)
    assert await p.slot_tokens(0) == 0
    assert count(p.decode.metrics.handoffs, "failed") == 1

    gone = HandoffRequest(
        "t1", "s1", p.prefill_engine, p.request("s1").body, prefill_node=f"http://127.0.0.1:{free_port()}"
    )
    with pytest.raises(Upstream, match="ConnectError"):
        await p.decode.handoff(p.decode_engine, "0", gone)
    assert count(p.decode.metrics.handoffs, "failed") == 2
    out = await p.handoff("s1")  # and the peer serves the next one
    assert out.tokens > 100
    assert not p.leftovers()


async def test_a_caller_that_leaves_cancels_the_prefill_on_the_other_node(
    pair: Callable[..., Any], tiny_model: Callable[..., str]
) -> None:
    model = tiny_model("qwen35")
    p = await pair(model, model, 8192)
    long = [*MESSAGES[:1], {"role": "user", "content": _tool_output(250)}]  # seconds of prefill
    task = asyncio.create_task(p.handoff("s1", messages=long))
    http, url = p.prefill.parts.http, p.prefill.engines[p.prefill_engine].url

    async def processing() -> bool:
        return any(s["is_processing"] for s in (await http.get(f"{url}/slots")).json())

    await until(processing, 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    async def idle() -> bool:
        return not await processing()

    await until(idle, 10)  # the peer saw its caller go, and its engine stopped at its next batch
    assert count(p.decode.metrics.handoffs, "cancelled") == 1

    async def counted() -> bool:
        return count(p.prefill.metrics.peer_prefills, "cancelled") == 1

    await until(counted, 10)
    assert await p.slot_tokens(0) == 0
    assert not p.leftovers()


async def test_the_peers_route_refuses_what_it_must(
    pair: Callable[..., Any], tiny_model: Callable[..., str]
) -> None:
    p = await pair(tiny_model("qwen35"), tiny_model("qwen35"))
    url = p.url + prefill_path(p.prefill_engine)
    head = json.dumps(p.request("s1").to_json() | {"prefill_node": ""}).encode() + b"\n"
    typed = {"content-type": HANDOFF_MEDIA}
    async with httpx.AsyncClient(timeout=30) as anyone:
        assert (await anyone.post(url, content=head, headers=typed)).status_code == 401
    http = p.decode.parts.http  # (with the internal credential)

    async def refused(content: bytes, path: str = url, headers: dict[str, str] = typed) -> tuple[int, str]:
        r = await http.post(path, content=content, headers=headers)
        return r.status_code, str(r.json()["error"]["message"])

    assert (await refused(head, headers={"content-type": "application/json"}))[0] == 400
    assert (await refused(b'{"tenant": "t1"'))[0] == 400  # no JSON line
    assert (await refused(head + b"stray bytes"))[0] == 400  # no carry, yet a file follows
    carry = json.dumps(p.request("s1").to_json() | {"prefill_node": "", "carry": True}).encode() + b"\n"
    assert (await refused(carry))[0] == 400  # carry, yet no file follows
    onward = json.dumps(p.request("s1").to_json()).encode() + b"\n"
    assert (await refused(onward))[0] == 400  # (a prefill is never sent on to a third node)
    other = json.dumps(p.request("s1").to_json() | {"prefill_node": "", "model": "other"}).encode() + b"\n"
    assert "serves" in (await refused(other))[1]
    assert (await refused(head, path=p.url + prefill_path("n1-e9")))[0] == 404
    bad = json.dumps(p.request("../x").to_json() | {"prefill_node": ""}).encode() + b"\n"
    assert (await refused(bad))[0] == 400
    assert not p.leftovers()


async def test_a_frames_json_line_is_bounded_and_the_rest_follows_it() -> None:
    async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    head, rest = await handoff_peer.read_head(chunks(b'{"a":', b"1}\nfile", b" bytes"), limit=16)
    assert head == b'{"a":1}' and b"".join([c async for c in rest]) == b"file bytes"
    with pytest.raises(ApiError) as err:
        await handoff_peer.read_head(chunks(b"x" * 10, b"x" * 10, b"\n"), limit=16)
    assert err.value.status == 413
    with pytest.raises(ApiError) as err:
        await handoff_peer.read_head(chunks(b'{"a":1}'), limit=16)
    assert err.value.status == 400

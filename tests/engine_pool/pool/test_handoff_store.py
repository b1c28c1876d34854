"""Handoffs through the store (engine_pool.pool.handoff_store), for two nodes that cannot reach each
other: the two node agents of support.node_pair (real engine processes, n1's node API served) share
a real S3 server (moto). The gateway's two calls are made as the gateway makes them: the prefill
with `to_store` to n1's node API (`NodeClient.prefill_to_store`), then the handoff with `from_store`
on n2.

The decode side evaluates 0 prompt tokens and answers as a turn that never left it; a damaged
object is refused (the slot left empty), a missing one fails the handoff; nothing is left in
either node's slot directories; the routes refuse a state from two places at once.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from support.node_pair import count, node_pairs, text

from engine_pool.errors import ApiError
from engine_pool.pool.client import NodeClient
from engine_pool.protocol.handoff import HANDOFF_MEDIA, handoff_key, prefill_path, stored_at
from gateway.bench.harness.servers import INTERNAL_KEY
from storage.blobs.s3client import make_s3_client
from storage.blobs.s3store import S3Store


@pytest.fixture
async def store(moto_server: Any) -> AsyncIterator[S3Store]:
    client = make_s3_client(endpoint_url=moto_server.endpoint, access_key="test", secret_key="test")
    s3 = S3Store(client, "slots", prefix=f"h{uuid.uuid4().hex[:8]}", close_client=True)
    yield s3
    await s3.aclose()


@pytest.fixture
async def pair(tmp_path: Path, store: S3Store) -> AsyncIterator[Callable[..., Any]]:
    async with node_pairs(tmp_path) as start:

        async def with_store(prefill_model: str, decode_model: str) -> Any:
            return await start(prefill_model, decode_model, 1024, store)

        yield with_store


async def _exported(p: Any, session: str) -> tuple[str, Any]:
    """n1's prefill of the session's prompt, exported into a new handoff object: its key and the
    prefill's account."""
    key = handoff_key(uuid.uuid4().hex)
    ask = dataclasses.replace(p.request(session), prefill_node="", to_store=key)
    async with NodeClient(p.url, key=INTERNAL_KEY) as n1:
        return key, await n1.prefill_to_store(p.prefill_engine, ask)


def _install(p: Any, session: str, key: str) -> Any:
    return dataclasses.replace(p.request(session), prefill_node="", from_store=key)


async def test_a_state_through_the_store_answers_as_unsplit(
    pair: Callable[..., Any], tiny_model: Callable[..., str], store: S3Store
) -> None:
    model = tiny_model("qwen35")
    p = await pair(model, model)
    unsplit = await p.chat(1, "s-whole")
    n_prompt = unsplit["timings"]["prompt_n"]

    key, done = await _exported(p, "s-split")
    assert done.prompt_n == n_prompt and done.bytes > 0
    assert await store.object_size(stored_at(store.prefix, key)) == done.bytes
    out = await p.decode.handoff(p.decode_engine, "0", _install(p, "s-split", key))
    assert out.through_store and out.bytes == done.bytes and out.tokens == n_prompt
    split = await p.chat(0, "s-split", served="handoff")
    assert split["timings"]["prompt_n"] == 0 and split["timings"]["cache_n"] == n_prompt
    assert text(split) == text(unsplit) and text(split)
    assert count(p.prefill.metrics.peer_prefills, "done") == 1
    assert count(p.decode.metrics.handoffs, "done") == 1
    assert not p.leftovers()
    await store.delete_object(stored_at(store.prefix, key))  # (the gateway's part)


async def test_a_damaged_or_missing_object_fails_the_handoff_and_leaves_the_slot_empty(
    pair: Callable[..., Any], tiny_model: Callable[..., str], store: S3Store
) -> None:
    model = tiny_model("qwen35")
    p = await pair(model, model)
    key, done = await _exported(p, "s1")
    where = stored_at(store.prefix, key)
    data = bytearray(await store.get_object(where))
    data[len(data) // 2] ^= 0xFF
    await store.put_object(where, bytes(data))
    with pytest.raises(ApiError) as err:
        await p.decode.handoff(p.decode_engine, "0", _install(p, "s1", key))
    assert err.value.extra.get("kind") == "checksum_mismatch"
    assert count(p.decode.metrics.handoffs, "refused") == 1
    assert await p.slot_tokens(0) == 0

    await store.delete_object(where)
    with pytest.raises(ApiError):
        await p.decode.handoff(p.decode_engine, "0", _install(p, "s1", key))
    assert count(p.decode.metrics.handoffs, "failed") == 1
    assert await p.slot_tokens(0) == 0
    assert not p.leftovers()


async def test_a_state_comes_from_one_place_only(
    pair: Callable[..., Any], tiny_model: Callable[..., str]
) -> None:
    p = await pair(tiny_model("qwen35"), tiny_model("qwen35"))
    key = handoff_key(uuid.uuid4().hex)
    async with NodeClient(p.url, key=INTERNAL_KEY) as n1:
        for wrong in (
            dataclasses.replace(p.request("s1"), prefill_node="", from_store=key),  # no prefill
            dataclasses.replace(p.request("s1"), to_store=key),  # (onward to a third node)
        ):
            with pytest.raises(ApiError) as err:
                await n1.prefill_to_store(p.prefill_engine, wrong)
            assert err.value.status == 400
    for wrong in (
        dataclasses.replace(_install(p, "s1", key), carry=True),  # carried and stored
        dataclasses.replace(p.request("s1"), from_store=key),  # stored and from a node
        dataclasses.replace(p.request("s1"), prefill_node="", to_store=key),  # a prefill's field
    ):
        with pytest.raises(ApiError) as err:
            await p.decode.handoff(p.decode_engine, "0", wrong)
        assert err.value.status == 400
    bad = {**p.request("s1").to_json(), "prefill_node": "", "to_store": "../../etc/passwd"}
    line = json.dumps(bad).encode() + b"\n"
    headers = {"content-type": HANDOFF_MEDIA}
    r = await p.decode.parts.http.post(p.url + prefill_path(p.prefill_engine), content=line, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "to_store"
    assert not p.leftovers()

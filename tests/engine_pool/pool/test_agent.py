"""The node agent end to end: `slotkeeper node` subprocesses running a tiny qwen35 engine (1 × 2 slots),
a real redis-server, the local store or moto's S3 server, driven through `NodeClient`.

Reuse is proved the strong way: after spill → erase → fill into another slot, the same chat
request on the new slot reports `timings.cache_n > 0` and (almost) no prompt tokens processed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs
from support.variables import slotkeeper_env

from engine_pool.pool import supervisor
from engine_pool.pool.agent import NodeAgent, NodeParts
from engine_pool.pool.client import NodeClient, NodeError
from engine_pool.pool.settings import NodeSettings, SettingsError, parse_node_settings
from engine_pool.process.loop import cancel_and_wait
from engine_pool.protocol.node import UNSTORED, FillProgress, NodeHealth, UnstoredList
from gateway.bench.harness.servers import INTERNAL_AUTH, INTERNAL_KEY, MotoProcess
from storage.blobs.localstore import LocalStore
from storage.blobs.spillcache import SpillCache
from storage.errors import NotStored, StoreUnavailable, WriteConflict
from storage.ids import SlotRef, piece_key
from storage.index.engines import EngineRegistry
from storage.index.session_index import SessionIndex, SessionState
from storage.slotfile.reader import read_slot_file

from .test_supervisor import alive

REPO = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "user", "content": "Tell me about the weather, the time and the place of the meeting."}]
S3_ENV = {"SLOTKEEPER_S3_ACCESS_KEY": "test", "SLOTKEEPER_S3_SECRET_KEY": "test"}


def free_port() -> int:
    return supervisor.free_port("127.0.0.1")


def wait_for(probe: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if probe():
                return
        except (OSError, httpx.HTTPError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"{what} not within {timeout} s")


class NodeProcess:
    """One `slotkeeper node` subprocess (`python -m engine_pool.pool.main`)."""

    def __init__(
        self, tmp: Path, model: str, *args: str, node_id: str = "n1", env: dict[str, str] | None = None
    ):
        self.port, self.node_id, self.data = free_port(), node_id, tmp / "data"
        self.log_path = tmp / "node.log"
        tmp.mkdir(parents=True, exist_ok=True)
        cmd = [
            *(sys.executable, "-m", "engine_pool.pool.main"),
            *("--model", model, "--slots", "2", "--ctx", "512"),
            *("--port", str(self.port)),
            *("--node-id", node_id),
            *("--data-dir", str(self.data)),
            *("--engine-arg=-t", "--engine-arg=1"),
            *("--heartbeat-ttl", "3"),
            *args,
        ]
        env = {**os.environ, **(env or {})}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.url = f"http://127.0.0.1:{self.port}"
        self.engine: dict[str, Any] = {}
        try:
            wait_for(self._engine_ready, "node with a ready engine", timeout=60)
        except AssertionError:
            self.stop()
            raise AssertionError(self.log()[-4000:]) from None

    def _engine_ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"node exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
        engines = httpx.get(f"{self.url}/v1/engines", timeout=1, headers=INTERNAL_AUTH).json()["engines"]
        self.engine = engines[0]
        return bool(engines[0]["state"] == "ready")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM (the node drains and stops its engine), SIGKILL of both groups if that hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                for pgid in (self.proc.pid, self.engine.get("pid")):  # engines have groups of their own
                    with contextlib.suppress(ProcessLookupError, TypeError):
                        os.killpg(pgid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="module")
def redis_url(redis_port: int) -> str:
    return f"redis://127.0.0.1:{redis_port}/0"


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def start_node(tmp_path: Path, tiny_model: Callable[..., str]) -> Iterator[Callable[..., NodeProcess]]:
    nodes: list[NodeProcess] = []

    def start(*args: str, **kw: Any) -> NodeProcess:
        nodes.append(NodeProcess(tmp_path / f"node{len(nodes)}", tiny_model("qwen35"), *args, **kw))
        return nodes[-1]

    yield start
    for node in nodes:
        node.stop()


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Any]:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


async def stored(blobs: Path, prefix: str, key: str) -> tuple[int, str, str | None, int]:
    """A stored generation (its manifest key): size and model as the store says, and the
    fingerprint and token count of the slot file it assembles into."""
    from storage.chunks.chunkstore import ChunkedStore
    from storage.chunks.ledger import ChunkLedger
    from storage.ids import parse_manifest_key
    from storage.index.keyspace import in_process_redis

    ref = parse_manifest_key(prefix, key)
    assert ref is not None, key
    async with ChunkedStore(LocalStore(blobs, prefix=prefix), ChunkLedger(in_process_redis())) as store:
        meta = await store.head(ref)
        await store.get_to_file(ref, blobs.parent / "assembled.slot")
    sf = read_slot_file(blobs.parent / "assembled.slot")
    assert sf.checksum_ok and sf.size == meta.size
    return meta.size, meta.model, sf.fingerprint, sf.n_tokens


async def chat(engine_url: str, slot: int) -> dict[str, Any]:
    body = {"messages": MESSAGES, "id_slot": slot, "max_tokens": 4, "temperature": 0}
    async with httpx.AsyncClient(timeout=60, headers=INTERNAL_AUTH) as c:
        r = await c.post(f"{engine_url}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


async def slot_tokens(engine_url: str, slot: int) -> int:
    async with httpx.AsyncClient(timeout=10, headers=INTERNAL_AUTH) as c:
        return int((await c.get(f"{engine_url}/slots")).json()[slot]["n_tokens"])


async def test_spill_erase_fill_through_the_local_store(
    start_node: Callable[..., NodeProcess], redis_url: str, prefix: str
) -> None:
    # Restores one at a time (each is larger than a byte): the fills below go through the gate.
    flags = ("--redis-url", redis_url, "--redis-prefix", prefix, "--s3-prefix", prefix)
    node = start_node(*flags, "--restore-bytes-in-flight", "1")
    eng, url = node.engine["id"], node.engine["url"]
    assert (eng, node.engine["model"], node.engine["n_slots"]) == ("n1-e0", "qwen35-seed0", 2)
    first = await chat(url, 0)
    async with NodeClient(node.url, key=INTERNAL_KEY) as client:
        assert await client.health() == NodeHealth("ok", "n1")
        spilled = await client.spill(eng, 0, tenant="t1", session="s1", generation=1)
        assert spilled.uploaded and spilled.tokens == await slot_tokens(url, 0) > 0
        size, model, fingerprint, tokens = await stored(node.data / "blobs", prefix, spilled.key)
        assert (size, tokens) == (spilled.bytes, spilled.tokens)
        assert model == fingerprint and spilled.written > 0

        assert await client.erase(eng, 0) == spilled.tokens
        reports: list[FillProgress] = []
        filled = await client.fill(eng, 1, tenant="t1", session="s1", generation=1, progress=reports.append)
        assert (filled.tokens, filled.bytes, filled.source) == (spilled.tokens, spilled.bytes, "local")
        # Its copy here: nothing fetched, one report as the engine loads it (the whole state at hand).
        assert [(r.stage, r.bytes, r.total) for r in reports] == [("restoring", spilled.bytes, spilled.bytes)]
        again = await chat(url, 1)
        assert again["timings"]["cache_n"] > 0 and again["timings"]["prompt_n"] <= 1
        assert again["choices"][0]["message"] == first["choices"][0]["message"]

        # A file the engine refuses (not a slot file): 4xx with the engine's words, the slot left empty.
        junk = node.data / "junk.slot"
        await asyncio.to_thread(junk.write_bytes, b"not a slot file" * 100)
        async with LocalStore(node.data / "blobs", prefix=prefix) as store:
            from storage.ids import SlotRef

            await store.put_file(SlotRef("t1", "s2", 1), junk, model="x", n_tokens=0)
        for watch in (None, reports.append):  # the same refusal whether the fill reports or not
            with pytest.raises(NodeError) as bad:
                await client.fill(eng, 1, tenant="t1", session="s2", generation=1, progress=watch)
            assert (
                bad.value.status == 400
                and "bad_magic" in bad.value.message
                and "left empty" in bad.value.message
            )
        assert await slot_tokens(url, 1) == 0

        errors = [
            (client.fill(eng, 0, tenant="t1", session="s1", generation=7), 404),
            (client.fill("n1-e9", 0, tenant="t1", session="s1", generation=1), 404),
            (client.fill(eng, 0, tenant="t1", session="s1", generation=7, progress=print), 404),
            (client.erase(eng, 2), 404),
            (client.spill(eng, 0, tenant="t1", session="s1", generation=0), 400),
            (client.spill(eng, 0, tenant="../x", session="s1", generation=2), 400),
            (client.spill(eng, 0, tenant="t1", session="s1", generation=1), 409),  # already spilled
        ]
        for call, status in errors:
            with pytest.raises(NodeError) as err:
                await call
            assert err.value.status == status, err.value
    async with httpx.AsyncClient(headers=INTERNAL_AUTH) as c:
        r = await c.post(f"{node.url}/v1/engines/{eng}/slots/0/fill", content=b"[1]")
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        metrics = (await c.get(f"{node.url}/metrics")).text
    assert "slotkeeper_node_restore_bytes_in_flight 0.0" in metrics  # every fill gave its bytes back
    assert "slotkeeper_node_restores_waiting 0.0" in metrics


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


async def test_damaged_bytes_are_fetched_again_checked_or_refused_with_the_piece_named(
    start_node: Callable[..., NodeProcess], redis_url: str, prefix: str
) -> None:
    """A fill hands the engine bytes the store did not check (the engine checks them as it
    loads). Damaged ones: the copy on this disk goes, the store's is fetched again with the
    store's check and restored; when the store's own piece is damaged, the fill is refused naming
    it and the slot stays empty."""
    node = start_node("--redis-url", redis_url, "--redis-prefix", prefix, "--s3-prefix", prefix)
    eng, url = node.engine["id"], node.engine["url"]
    first = await chat(url, 0)
    cached = node.data / "spill" / "t1" / "s1" / f"{1:020d}.slot"
    async with NodeClient(node.url, key=INTERNAL_KEY) as client:
        spilled = await client.spill(eng, 0, tenant="t1", session="s1", generation=1)
        assert spilled.uploaded and cached.is_file()
        await client.erase(eng, 0)

        await asyncio.to_thread(_flip, cached, spilled.bytes // 2)  # this disk's copy, damaged
        filled = await client.fill(eng, 1, tenant="t1", session="s1", generation=1)
        assert (filled.tokens, filled.bytes, filled.source) == (spilled.tokens, spilled.bytes, "store")
        again = await chat(url, 1)
        assert again["timings"]["prompt_n"] <= 1
        assert again["choices"][0]["message"] == first["choices"][0]["message"]
        assert "node.fill_damaged" in node.log()

        await client.erase(eng, 1)
        assert await client.forget("t1", "s1") == 1  # no copy on this disk: from the store
        pieces = sorted((node.data / "blobs").rglob("*.kv"), key=lambda p: p.stat().st_size)
        await asyncio.to_thread(_flip, pieces[-1], pieces[-1].stat().st_size - 1)
        with pytest.raises(NodeError) as err:
            await client.fill(eng, 1, tenant="t1", session="s1", generation=1)
        assert pieces[-1].name in err.value.message, err.value.message
        assert await slot_tokens(url, 1) == 0


async def complete(engine_url: str, slot: int, prompt: list[int]) -> dict[str, Any]:
    body = {"prompt": prompt, "id_slot": slot, "n_predict": 4, "temperature": 0, "cache_prompt": True}
    async with httpx.AsyncClient(timeout=60, headers=INTERNAL_AUTH) as c:
        r = await c.post(f"{engine_url}/completion", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


async def test_a_prompt_that_leaves_the_session_early_is_restored_only_up_to_its_checkpoint(
    start_node: Callable[..., NodeProcess], redis_url: str, prefix: str
) -> None:
    """A fill with the prompt's tokens restores the stored pieces up to the checkpoint the prompt
    continues from ("cut"), and the engine answers as after the whole restore; without tokens the
    whole generation is restored. Bad tokens: 400."""
    node = start_node(
        *("--redis-url", redis_url, "--redis-prefix", prefix),
        *("--s3-prefix", prefix),
        *("--spill-bytes", "0"),
        *("--engine-arg=--checkpoint-interval", "--engine-arg=64"),
    )
    eng, url = node.engine["id"], node.engine["url"]
    async with httpx.AsyncClient(timeout=10, headers=INTERNAL_AUTH) as c:
        text = "The agent reads the failing test, edits the parser and runs the suite again. " * 30
        tokens = (await c.post(f"{url}/tokenize", json={"content": text})).json()["tokens"][:300]
    await complete(url, 0, tokens)  # checkpoints at 64, 128, 192, 256 and 300
    async with NodeClient(node.url, key=INTERNAL_KEY) as client:
        spilled = await client.spill(eng, 0, tenant="t1", session="s1", generation=1)
        await client.erase(eng, 0)
        prompt = tokens[:200] + tokens[50:90]  # leaves the session after 200 tokens

        whole = await client.fill(eng, 1, tenant="t1", session="s1", generation=1)
        assert (whole.source, whole.tokens) == ("store", spilled.tokens)
        after_whole = await complete(url, 1, prompt)
        await client.erase(eng, 1)

        cut = await client.fill(eng, 1, tenant="t1", session="s1", generation=1, tokens=prompt)
        assert (cut.source, cut.tokens) == ("cut", 192) and cut.bytes < whole.bytes
        after_cut = await complete(url, 1, prompt)
        assert after_cut["content"] == after_whole["content"]
        assert after_cut["timings"]["prompt_n"] == after_whole["timings"]["prompt_n"] == len(prompt) - 192
        await client.erase(eng, 1)

        # the first prompt again, something else after it instead of the answer: its end's checkpoint
        retry = await client.fill(eng, 1, tenant="t1", session="s1", generation=1, tokens=tokens + [5, 6])
        assert (retry.source, retry.tokens) == ("cut", 300) and spilled.tokens > 300
        # without tokens (or with a prompt the store cannot cut for): the whole generation
        await client.erase(eng, 1)
        again = await client.fill(eng, 1, tenant="t1", session="s1", generation=1)
        assert (again.source, again.tokens) == ("store", spilled.tokens)
        async with httpx.AsyncClient(headers=INTERNAL_AUTH) as c:
            bad = {"tenant": "t1", "session": "s1", "generation": 1, "tokens": [1, -2]}
            r = await c.post(f"{node.url}/v1/engines/{eng}/slots/1/fill", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def s3_node(start: Callable[..., NodeProcess], moto: MotoProcess, prefix: str, *flags: str) -> NodeProcess:
    """A node on `moto`'s S3 that keeps no copy of what it uploaded and retries uploads quickly."""
    return start(
        *("--s3-endpoint", moto.endpoint, "--s3-bucket", "slots", "--s3-prefix", prefix),
        *("--spill-bytes", "0", "--flush-interval", "0.3", *flags),
        env=S3_ENV,
    )


async def test_s3_store_down_during_spill_then_flushed(
    start_node: Callable[..., NodeProcess], restartable_moto: MotoProcess, prefix: str
) -> None:
    node = s3_node(start_node, restartable_moto, prefix)
    eng, url = node.engine["id"], node.engine["url"]
    s3 = restartable_moto.client()
    await chat(url, 0)
    async with NodeClient(node.url, key=INTERNAL_KEY) as client:
        up = await client.spill(eng, 0, tenant="t1", session="s1", generation=1)
        assert up.uploaded
        plan = json.loads(s3.get_object(Bucket="slots", Key=up.key)["Body"].read())["plan"]
        assert (plan["size"], plan["n_tokens"]) == (up.bytes, up.tokens)  # the manifest of the chunks
        filled = await client.fill(eng, 1, tenant="t1", session="s1", generation=1)
        assert filled.source == "store"  # a budget of 0 bytes keeps nothing that is safely uploaded
        assert (await chat(url, 1))["timings"]["cache_n"] > 0

        restartable_moto.kill()
        down = await client.spill(eng, 1, tenant="t1", session="s1", generation=2)
        assert not down.uploaded
        local = node.data / "spill" / "t1" / "s1" / f"{2:020d}.slot"
        assert (
            await asyncio.to_thread(local.stat)
        ).st_size == down.bytes  # kept although over budget: not uploaded yet
        # Only this node holds it now: it says so (what a lost index is rebuilt from), to the key only.
        async with httpx.AsyncClient(timeout=10) as http:
            assert (await http.get(node.url + UNSTORED)).status_code == 401
            answer = await http.get(node.url + UNSTORED, headers=INTERNAL_AUTH)
            listed = UnstoredList.from_json(answer.json())
            assert [(c.tenant, c.session, c.generation, c.key, c.bytes, c.tokens) for c in listed.copies] == [
                ("t1", "s1", 2, down.key, down.bytes, down.tokens)
            ]
            assert listed.copies[0].model and listed.copies[0].saved_at > 0
            one = await http.get(
                node.url + UNSTORED, params={"tenant": "t1", "session": "s1"}, headers=INTERNAL_AUTH
            )
            other = await http.get(
                node.url + UNSTORED, params={"tenant": "t1", "session": "s2"}, headers=INTERNAL_AUTH
            )
            assert UnstoredList.from_json(one.json()) == listed and other.json()["copies"] == []
            for hostile in ({"tenant": "t1"}, {"session": "s1"}, {"tenant": "t1", "session": "../s1"}):
                refused = await http.get(node.url + UNSTORED, params=hostile, headers=INTERNAL_AUTH)
                assert refused.status_code == 400, (hostile, refused.text)
            restartable_moto.start()
            wait_for(lambda: restartable_moto.exists(down.key), "flush after the store is back", timeout=20)
            manifest = json.loads(s3.get_object(Bucket="slots", Key=down.key)["Body"].read())
            assert manifest["plan"]["size"] == down.bytes
            unlisted = lambda: not httpx.get(node.url + UNSTORED, headers=INTERNAL_AUTH).json()["copies"]  # noqa: E731
            wait_for(unlisted, "no longer listed once stored")
    s3.close()


async def test_a_long_session_from_s3_restores_whole_and_a_damaged_chunk_is_refused(
    start_node: Callable[..., NodeProcess], restartable_moto: MotoProcess, prefix: str
) -> None:
    """A session of a few thousand tokens (a dozen KV chunks), stored in S3 and filled back by a node
    that keeps no copy: the engine continues it as the live slot did. One chunk in the middle of
    the plan damaged in the store: the engine refuses the bytes, the node fetches them again
    checked, refuses the fill naming that chunk, and leaves the slot empty (the gateway's turn
    then prefills)."""
    node = s3_node(start_node, restartable_moto, prefix, "--ctx", "4096")
    eng, url = node.engine["id"], node.engine["url"]
    async with httpx.AsyncClient(timeout=10, headers=INTERNAL_AUTH) as c:
        text = "The agent reads the failing test, edits the parser and runs the suite again. " * 200
        tokens = (await c.post(f"{url}/tokenize", json={"content": text})).json()["tokens"][:3000]
    first = await complete(url, 0, tokens)
    s3 = restartable_moto.client()
    async with NodeClient(node.url, key=INTERNAL_KEY) as client:
        spilled = await client.spill(eng, 0, tenant="t1", session="s1", generation=1)
        assert spilled.uploaded and spilled.tokens > 3000
        await client.erase(eng, 0)
        reports: list[FillProgress] = []
        filled = await client.fill(eng, 1, tenant="t1", session="s1", generation=1, progress=reports.append)
        assert (filled.source, filled.tokens, filled.bytes) == ("store", spilled.tokens, spilled.bytes)
        # Reported as it went: the fetch from its start, its bytes growing to the state's, then the restore.
        stages = [r.stage for r in reports]
        assert stages[0] == "fetching" and stages[-1] == "restoring" and stages.count("restoring") == 1
        fetched = [r.bytes for r in reports if r.stage == "fetching"]
        assert fetched[0] == 0 and fetched == sorted(fetched)  # (how many between: the fetch's pace)
        assert fetched[-1] == reports[-1].bytes == spilled.bytes == reports[0].total
        assert [r.ms for r in reports] == sorted(r.ms for r in reports) and reports[-1].ms <= filled.ms
        again = await complete(url, 1, tokens)
        assert again["timings"]["prompt_n"] <= 1 and again["content"] == first["content"]

        await client.erase(eng, 1)
        manifest = json.loads(s3.get_object(Bucket="slots", Key=spilled.key)["Body"].read())
        chunks = manifest["plan"]["chunks"]
        assert len(chunks) >= 10
        name = chunks[len(chunks) // 2][0]
        key = piece_key(prefix, "t1", manifest["ns"], name, "kv")
        damaged = bytearray(s3.get_object(Bucket="slots", Key=key)["Body"].read())
        damaged[len(damaged) // 2] ^= 0xFF
        s3.put_object(Bucket="slots", Key=key, Body=bytes(damaged))
        refused = []
        for watch in (None, reports.append):  # the same refusal whether the fill reports or not
            reports.clear()
            with pytest.raises(NodeError) as err:
                await client.fill(eng, 1, tenant="t1", session="s1", generation=1, progress=watch)
            assert name in err.value.message, err.value.message
            refused.append((err.value.status, err.value.type, err.value.code, err.value.message))
        assert refused[0] == refused[1]
        assert refused[0][:3] == (422, "invalid_request_error", "slot_file_invalid")
        # Reported up to the damage: fetched and restored (refused), fetched again checked, refused.
        assert [r.stage for r in reports].count("restoring") == 1 and reports[-1].stage == "fetching"
        assert await slot_tokens(url, 1) == 0
        assert "node.fill_damaged" in node.log()
    s3.close()


async def test_saves_waiting_for_the_store_are_bounded(
    start_node: Callable[..., NodeProcess], restartable_moto: MotoProcess, prefix: str
) -> None:
    node = s3_node(start_node, restartable_moto, prefix, "--spill-pending-bytes", "1")
    eng, url = node.engine["id"], node.engine["url"]
    await chat(url, 0)
    async with NodeClient(node.url, key=INTERNAL_KEY) as client:
        restartable_moto.kill()
        first = await client.spill(eng, 0, tenant="t1", session="s1", generation=1)
        assert not first.uploaded  # kept on disk for the store
        with pytest.raises(NodeError) as held:  # the bound is reached: no more until the store is back
            await client.spill(eng, 0, tenant="t1", session="s1", generation=2)
        assert held.value.status == 503 and "waiting for the store" in held.value.message
        async with httpx.AsyncClient(headers=INTERNAL_AUTH, timeout=10) as http:
            shown = (await http.get(node.url + "/metrics")).text
        assert f"slotkeeper_node_uploads_pending_bytes {float(first.bytes)}" in shown
        restartable_moto.start()
        wait_for(lambda: restartable_moto.exists(first.key), "flush after the store is back", timeout=20)
        again = await client.spill(eng, 0, tenant="t1", session="s1", generation=2)
        assert again.uploaded


async def test_sigterm_drains_live_sessions(
    start_node: Callable[..., NodeProcess], redis_url: str, redis: Any, prefix: str
) -> None:
    node = start_node("--redis-url", redis_url, "--redis-prefix", prefix, "--s3-prefix", prefix, node_id="n3")
    eng, url, engine_pid = node.engine["id"], node.engine["url"], node.engine["pid"]
    registry, index = EngineRegistry(redis, prefix=prefix), SessionIndex(redis, prefix=prefix)
    for _ in range(50):  # registered (after the node dropped whatever the index placed on it before)
        if [e.engine_id for e in await registry.list()] == [eng]:
            break
        await asyncio.sleep(0.1)
    assert [(e.engine_id, e.url, e.model, e.instance) for e in await registry.list()] == [
        (eng, url, "qwen35-seed0", node.engine["instance"])
    ]
    assert node.engine["instance"]  # the process's own (the fence a gateway's early call names)
    for slot, session in ((0, "old"), (1, "new")):
        await chat(url, slot)
        await index.mark_live("t1", session, engine=eng, slot=slot, tokens=await slot_tokens(url, slot))
    await index.set_durable("t1", "old", generation=4, blob_key="earlier", nbytes=1)

    node.proc.send_signal(signal.SIGTERM)
    assert node.proc.wait(60) == 0, node.log()[-4000:]
    for session, generation in (("old", 5), ("new", 1)):
        record = await index.get("t1", session)
        assert (record.state, record.generation, record.engine) == (SessionState.SPILLED, generation, None)
        size, _, _, tokens = await stored(node.data / "blobs", prefix, record.blob_key)
        assert size == record.bytes and tokens == record.tokens > 0
    assert await index.engine_sessions(eng) == [] and await registry.list() == []
    assert not alive(engine_pid)


async def test_engine_crash_drops_its_sessions_and_restarts(
    start_node: Callable[..., NodeProcess], redis_url: str, redis: Any, prefix: str
) -> None:
    node = start_node("--redis-url", redis_url, "--redis-prefix", prefix, node_id="n4")
    eng, first_pid = node.engine["id"], node.engine["pid"]
    registry, index = EngineRegistry(redis, prefix=prefix), SessionIndex(redis, prefix=prefix)
    for _ in range(50):
        if await registry.list():
            break
        await asyncio.sleep(0.1)
    await index.mark_live("t1", "s1", engine=eng, slot=0, tokens=10)
    os.killpg(first_pid, signal.SIGKILL)
    async with NodeClient(node.url, key=INTERNAL_KEY) as client:
        for _ in range(100):
            view = (await client.engines())[0]
            if view.state == "ready" and view.pid != first_pid:
                break
            await asyncio.sleep(0.1)
        assert (view.state, view.restarts) == ("ready", 1)
        assert view.url and await slot_tokens(view.url, 0) == 0  # a new process: empty slots
    record = await index.get("t1", "s1")
    assert (record.state, record.engine) == (SessionState.NEW, None)  # its slot died with the engine
    for _ in range(50):
        infos = await registry.list()
        if infos and infos[0].url == view.url:
            break
        await asyncio.sleep(0.1)
    assert [(i.engine_id, i.url) for i in infos] == [(eng, view.url)]


async def test_client_retries_only_before_the_first_byte() -> None:
    """A connection closed before any response is retried on a new connection; a broken-off one is not."""
    connections: list[int] = []
    body = b'{"status": "ok", "node": "fake"}'
    ok = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )
    broken = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            await reader.readuntil(b"\r\n\r\n")
            if mode == "close-first" and len(connections) == 1:
                return  # like a keep-alive connection the server dropped: no byte of a response
            writer.write(broken if mode == "broken" else ok)
            await writer.drain()
        finally:  # also when the test's end cancels it: a socket left open warns wherever GC finds it
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, NodeClient(f"http://127.0.0.1:{port}", key=INTERNAL_KEY) as client:
        mode = "close-first"
        assert await client.health() == NodeHealth("ok", "fake")
        assert len(connections) == 2
        connections.clear()
        with pytest.raises(NodeError) as err:  # spill is not idempotent: not retried after sending
            await client.spill("e", 0, tenant="t", session="s", generation=1)
        assert (err.value.status, err.value.type, len(connections)) == (502, "node_unreachable", 1)
        mode, connections[:] = "broken", []
        with pytest.raises(NodeError) as err:
            await client.health()
        assert (err.value.type, len(connections)) == ("node_unreachable", 1)


def test_node_settings_from_flags_and_environment() -> None:
    env = slotkeeper_env(models="/m/a.gguf, /m/b.gguf", aliases="alpha", slots="4", internal_key="k-1")
    s = parse_node_settings(["--node-id", "n9", "--ctx", "1024", "--engine-arg=-t", "--engine-arg", "2"], env)
    assert s.models == ("/m/a.gguf", "/m/b.gguf") and s.model_ids == ("alpha", "b")
    specs = s.engine_specs()
    assert [(e.engine_id, e.model_id, e.n_slots, e.n_ctx) for e in specs] == [
        ("n9-e0", "alpha", 4, 4096),
        ("n9-e1", "b", 4, 4096),
    ]
    assert specs[1].extra_args == ("-t", "2") and specs[1].slot_dir.name == "slots"
    assert parse_node_settings(["-m", "x.gguf", "--slots", "2"], env).models == ("x.gguf",)  # flag wins
    for argv, message in (
        ([], "--model is required"),
        (["-m", "x", "--node-id", "a/b"], "--node-id must be a valid id"),
        (["-m", "x", "--spill-bytes", "lots"], "--spill-bytes: invalid value"),
        (["-m", "x", "--s3-endpoint", "http://s3"], "--s3-endpoint needs --s3-bucket"),
        (["-m", "x", "--alias", "a", "--alias", "b"], "2 --alias for 1 --model"),
        (["-m", "x", "--store-compression", "zstd"], "--store-compression must be on, off or auto"),
    ):
        with pytest.raises(SettingsError, match=message):
            parse_node_settings(argv, {"SLOTKEEPER_INTERNAL_KEY": "k"})
    with pytest.raises(SettingsError, match="SLOTKEEPER_INTERNAL_KEY is required"):
        parse_node_settings(["-m", "x"], {})


@pytest.mark.parametrize(
    ("argv", "compresses"),
    [
        ([], False),  # a local disk: restores read at disk speed
        (["--s3-bucket", "b"], False),  # S3 too: decoding costs more than the bytes it saves
        (["--store-compression", "on"], True),
        (["--store-compression", "auto"], False),  # auto: S3 only
        (["--s3-bucket", "b", "--store-compression", "auto"], True),
        (["--s3-bucket", "b", "--store-compression", "off"], False),
    ],
)
def test_recurrent_states_are_stored_as_they_are_unless_told(argv: list[str], compresses: bool) -> None:
    s = parse_node_settings(["-m", "x.gguf", *argv], {"SLOTKEEPER_INTERNAL_KEY": "k"})
    assert s.compresses_states is compresses


def test_engines_get_the_key_but_not_the_node_settings_or_store_secrets() -> None:
    ours = slotkeeper_env(internal_key="k-2", s3_secret_key="s3-secret", port="8070")
    node_env = {"PATH": "/bin", "HOME": "/h", "AWS_SECRET_ACCESS_KEY": "aws-secret", **ours}
    s = parse_node_settings(["-m", "x.gguf"], node_env)
    env = dict(s.engine_specs(node_env)[0].env or ())
    assert env == {"PATH": "/bin", "HOME": "/h", "SLOTKEEPER_API_KEY": "k-2"}


@pytest.mark.parametrize(
    ("bucket", "redis", "says"),
    [
        ("no-such-bucket", None, "NoSuchBucket"),  # moto: a bucket that does not exist
        ("slots", "redis://127.0.0.1:1/0", "redis"),  # nothing listens there
    ],
)
def test_a_node_with_an_unusable_store_or_redis_refuses_to_start(
    tmp_path: Path,
    tiny_model: Callable[..., str],
    restartable_moto: MotoProcess,
    bucket: str,
    redis: str | None,
    says: str,
) -> None:
    """Found at start, not at the first spill: the node exits non-zero with the precise cause and
    never registers or starts an engine."""
    cmd = [
        *(sys.executable, "-m", "engine_pool.pool.main"),
        *("--model", tiny_model("qwen35")),
        *("--port", str(free_port())),
        *("--data-dir", str(tmp_path / "data")),
        *("--s3-endpoint", restartable_moto.endpoint, "--s3-bucket", bucket),
        *(["--redis-url", redis] if redis else []),
    ]
    done = subprocess.run(
        cmd, cwd=REPO, env={**os.environ, **S3_ENV}, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert "slotkeeper node: cannot start: " in done.stderr and says in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "data" / "engines").exists() or not any(
        (tmp_path / "data" / "engines").rglob("engine.log")
    )


class _FlakyCache:
    """A spill cache with one file pending whose first two flushes fail: once the store is down,
    once with an error nobody planned for (a bug, a file gone)."""

    def __init__(self) -> None:
        self.ref = SlotRef("t1", "s1", 1)
        self.failures: list[BaseException] = [StoreUnavailable("the store is down"), KeyError("a bug")]
        self.flushed = asyncio.Event()

    def pending(self) -> list[SlotRef]:
        return [] if self.flushed.is_set() else [self.ref]

    async def flush(self, store: object) -> list[SlotRef]:
        if self.failures:
            raise self.failures.pop(0)
        self.flushed.set()
        return [self.ref]


async def test_the_flush_loop_outlives_any_failure_of_a_flush() -> None:
    cache = _FlakyCache()
    settings = NodeSettings(models=(), flush_interval_s=0.01)
    parts = NodeParts(store=None, cache=cache, index=None, registry=None, http=None)  # type: ignore[arg-type]
    agent = NodeAgent(settings, parts)
    with capture_logs() as logs:
        loop = asyncio.create_task(agent._flush_loop())
        try:
            await asyncio.wait_for(cache.flushed.wait(), 10)
        finally:
            await cancel_and_wait(loop)
    events = [e["event"] for e in logs]
    assert events.count("node.flushing") == 3
    assert [e for e in events if e.startswith("node.flush")] == [
        "node.flushing",
        "node.flush_failed",  # the store is down: backs off
        "node.flushing",
        "node.flush_error",  # an unplanned error: logged with its traceback, backs off
        "node.flushing",
        "node.flushed",
    ]


# What `read_slot_file` says of the file these tests save (1000 bytes, not a slot file).
SAVED: Any = SimpleNamespace(fingerprint="m", n_tokens=6, size=1000)


class _ClaimingStore:
    """Puts of one generation claim it for as long as they run (as the chunked store's do): a put
    while another runs is a WriteConflict, and the object is not visible until the first has finished."""

    def __init__(self) -> None:
        self.go, self.running, self.stored = asyncio.Event(), asyncio.Event(), False
        self.puts = 0

    async def put_file(self, ref: SlotRef, path: Path, **kwargs: Any) -> Any:
        self.puts += 1
        if self.running.is_set():
            raise WriteConflict(f"generation {ref.generation} of session {ref.session} is being stored")
        self.running.set()
        try:
            await self.go.wait()
        finally:
            self.running.clear()
        self.stored = True
        return SimpleNamespace(written=1000)

    async def head(self, ref: SlotRef) -> Any:
        if not self.stored:
            raise NotStored(f"no generation {ref.generation} of session {ref.session}")
        raise AssertionError("not asked for in these tests")


async def test_the_flush_loop_keeps_off_a_spill_while_it_uploads(tmp_path: Path) -> None:
    """The spill's own upload and the flush loop never race for one generation (the loser saw
    WriteConflict, then no object: the spill failed and its turn was never recorded durable)."""
    store, cache = _ClaimingStore(), await SpillCache.open(tmp_path / "cache", max_bytes=1 << 30)
    parts = NodeParts(store=store, cache=cache, index=None, registry=None, http=None)  # type: ignore[arg-type]
    agent = NodeAgent(NodeSettings(models=(), flush_interval_s=0.005), parts)
    ref, src = SlotRef("t1", "s1", 1), tmp_path / "saved.slot"
    src.write_bytes(b"x" * 1000)
    with capture_logs() as logs:
        loop = asyncio.create_task(agent._flush_loop())
        try:
            keep = asyncio.create_task(agent._keep(ref, src, SAVED, 0))
            await asyncio.wait_for(store.running.wait(), 10)
            flushes = sum(e["event"] == "node.flushing" for e in logs)
            await asyncio.sleep(0.05)  # ten flush intervals while the spill uploads: none takes it up
            assert sum(e["event"] == "node.flushing" for e in logs) == flushes and store.puts == 1
            store.go.set()
            assert await asyncio.wait_for(keep, 10) == 1000
        finally:
            await cancel_and_wait(loop)
    assert cache.is_uploaded(ref) and cache.pending() == [] and store.puts == 1
    assert not [e for e in logs if e["event"] in ("node.flush_failed", "node.flush_error")]


async def test_a_spill_another_writer_is_storing_stays_pending(tmp_path: Path) -> None:
    store, cache = _ClaimingStore(), await SpillCache.open(tmp_path / "cache", max_bytes=1 << 30)
    parts = NodeParts(store=store, cache=cache, index=None, registry=None, http=None)  # type: ignore[arg-type]
    agent = NodeAgent(NodeSettings(models=()), parts)
    ref, src = SlotRef("t1", "s1", 1), tmp_path / "saved.slot"
    src.write_bytes(b"x" * 1000)
    store.running.set()  # someone else holds the generation's claim, its object not visible yet
    with capture_logs() as logs:
        assert await agent._keep(ref, src, SAVED, 0) is None  # deferred, not failed
    assert cache.pending() == [ref] and not cache.is_uploaded(ref)  # the flush's to confirm
    deferred = [e["error"] for e in logs if e["event"] == "node.upload_deferred"]
    assert deferred == ["being stored by another writer"]

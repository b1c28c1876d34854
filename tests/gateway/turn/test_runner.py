"""The request path's fault rules, in process on the in-process index: locks renewed while a turn runs,
a failed or timed-out request fails alone, fork ids always valid."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import fakeredis
import httpx
import pytest

from engine_pool.errors import GatewayTimeout, Unavailable
from gateway.cluster import Cluster
from gateway.metrics import Metrics
from gateway.tenants import Tenant
from gateway.turn.engine_call import TurnOutcome, engine_session, forward_json
from gateway.turn.forward import Asked, Ending
from gateway.turn.hold import fork_id, hold_for_turn
from gateway.turn.parts import Turn, TurnParts, TurnSettings
from gateway.turn.runner import TurnRunner
from gateway.turn.slot_choice import Placement, Serve
from storage.blobs.localstore import LocalStore
from storage.ids import validate_id
from storage.index.engines import EngineRegistry
from storage.index.locks import TURN, WORK, SessionLocks
from storage.index.session_index import SessionIndex, SessionState


@pytest.fixture
async def parts(tmp_path):
    redis = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    index, locks = SessionIndex(redis), SessionLocks(redis)
    async with httpx.AsyncClient() as http:
        cluster = Cluster(EngineRegistry(redis), index, (), http)
        yield index, locks, cluster, LocalStore(tmp_path / "blobs")
    await redis.aclose()


def _runner(parts, ttl_s: float = 0.3) -> TurnRunner:
    index, locks, cluster, store = parts
    settings = TurnSettings(lock_ttl_s=ttl_s, spill_wait_s=1.0)
    return TurnRunner(TurnParts(cluster, index, locks, store, Metrics(), settings))


async def test_the_lock_is_renewed_while_a_turn_runs_and_lapses_after(parts) -> None:
    runner = _runner(parts, ttl_s=0.3)
    _, locks, _, _ = parts
    lock = await locks.try_acquire("t", "s", ttl_s=0.3)
    assert lock is not None
    hold = runner.parts.holds.start(lock, None)
    await asyncio.sleep(1.0)  # over three TTLs: without renewal the lock would be gone
    assert await locks.owner("t", "s") == lock.token
    hold.keeper.cancel()
    deadline = asyncio.get_running_loop().time() + 5
    while await locks.owner("t", "s") is not None:  # nobody renews it now: it lapses by itself
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.05)


async def test_a_turn_that_cannot_be_placed_leaves_its_live_session_idle_in_its_slot(parts) -> None:
    """The opening read marks a live session busy; a turn that then fails before it runs (here: its
    engine left the registry and no other has a slot) puts it back into its engine's idle LRU."""
    index, locks, _, _ = parts
    runner = _runner(parts)
    await index.create("t", "s", model="m")
    await index.mark_live("t", "s", engine="e1", slot=0, tokens=10, model="m")
    await index.mark_idle("t", "s")
    with pytest.raises(Unavailable):
        await runner.start(Tenant("t"), {}, {}, "m", None, ("s", "header"))
    rec = await index.get("t", "s")
    assert (rec.state, rec.engine, rec.slot) == (SessionState.LIVE, "e1", 0)
    assert await index.is_idle("t", "s")  # evictable again
    assert await locks.owner("t", "s") is None and runner.parts.holds.get("t", "s") is None


@pytest.mark.parametrize(("holder", "forked"), [(WORK, False), (TURN, True)])
async def test_a_turn_waits_for_an_eviction_of_its_session_and_forks_only_around_a_turn(
    parts, holder: str, forked: bool
) -> None:
    """A finish that Redis missed leaves the session live but not idle; an eviction then holds its
    lock while it saves it. The next turn waits for that (it is then restored from the save); only
    a turn running on the session is forked around."""
    index, locks, _, _ = parts
    runner = _runner(parts, ttl_s=5.0)
    await index.create("t", "s", model="m")
    await index.mark_live("t", "s", engine="e1", slot=0, tokens=10, model="m")  # busy, as left
    other = await locks.try_acquire("t", "s", ttl_s=5.0, holder=holder)
    assert other is not None
    start = await index.start_turn("t", "s", lock_ttl_s=5.0, inflight_limit=8, inflight_ttl_s=60)
    assert start.lock is None  # held by the other

    async def other_done() -> None:
        await asyncio.sleep(0.2)  # the other holder's work
        await locks.release(other)

    done = asyncio.create_task(other_done())
    hold = await hold_for_turn(runner.parts, "t", "s", start)
    await done
    assert (hold is None) is forked
    if hold is not None:
        assert hold.lock.token != other.token and await locks.owner("t", "s") == hold.lock.token
        await runner.parts.holds.let_go(hold)


async def test_a_failed_request_fails_alone_and_drops_no_session(parts) -> None:
    index, locks, _, _ = parts
    runner = _runner(parts)
    for session, slot in (("mine", 0), ("other", 1)):
        await index.create("t", session, model="m")
        await index.mark_live("t", session, engine="e1", slot=slot, tokens=10)
    lock = await locks.try_acquire("t", "mine", ttl_s=5)
    assert lock is not None
    hold = runner.parts.holds.start(lock, await index.find("t", "mine"))
    turn = Turn(Tenant("t"), "mine", "m", hold, Placement("e1", 0, Serve.LIVE), "http://e1", None, "header")  # type: ignore[arg-type]
    await runner.finish(turn, [], TurnOutcome(error="the engine did not answer in time"))
    for session in ("mine", "other"):
        rec = await index.get("t", session)
        assert (rec.state, rec.engine) == (SessionState.LIVE, "e1")
    assert await index.is_idle("t", "mine")
    assert await locks.owner("t", "mine") is None  # released


async def test_an_engine_that_does_not_answer_in_time_gets_504_for_that_request() -> None:
    accepted, gone = asyncio.Event(), asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()
        try:
            await reader.read()  # never answers; returns when the client gives up and closes
        finally:
            writer.close()
            gone.set()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        async with engine_session({}, request_timeout_s=0.3) as client:
            with pytest.raises(GatewayTimeout) as err:
                await forward_json(client, f"http://127.0.0.1:{port}/v1/chat/completions", {"x": 1})
        await asyncio.wait_for(gone.wait(), 5)
    assert accepted.is_set()
    assert (err.value.status, err.value.code) == (504, "engine_timeout")


@pytest.mark.parametrize("parent", ["dot2.", "a", "x" * 128, "a.b.", "s-" + "9" * 30])
def test_fork_ids_are_always_valid_and_short_enough(parent: str) -> None:
    fork = fork_id(parent)
    assert validate_id(fork, "fork") == fork and len(fork) <= 128 and fork != parent
    assert fork.startswith(parent[:110].rstrip("."))


async def test_models_that_nodes_run_but_no_engine_serves_yet_are_told_from_unknown_ones(parts) -> None:
    index, locks, _, _ = parts
    crashed = {
        "id": "n1-e0",
        "model": "qwen35",
        "url": None,
        "state": "crashed",
        "n_slots": 1,
        "restarts": 1,
        "pid": None,
    }
    answers = {"http://n1": {"node": "n1", "engines": [crashed]}}

    def node(request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}"
        if url not in answers:
            raise httpx.ConnectError("down", request=request)
        return httpx.Response(200, json=answers[url])

    async with httpx.AsyncClient(transport=httpx.MockTransport(node)) as http:
        up = Cluster(EngineRegistry(index._redis), index, ("http://n1",), http)
        assert await up.models() == set()  # nothing registered: no engine is ready
        assert await up.configured_models() == {"qwen35"}  # but a node runs one: 503, not 404
        half = Cluster(EngineRegistry(index._redis), index, ("http://n1", "http://n2"), http)
        assert await half.configured_models() is None  # a node did not answer: nobody can say 404


async def test_a_turn_ends_once_whoever_ends_it(parts) -> None:
    """A stream's end and its response's background both end the turn (gateway.turn.forward.Ending):
    the bookkeeping runs once, and only the answer is counted."""
    index, locks, _, _ = parts
    runner = _runner(parts)
    await index.create("t", "once", model="m")
    await index.mark_live("t", "once", engine="e1", slot=0, tokens=10)
    lock = await locks.try_acquire("t", "once", ttl_s=5)
    assert lock is not None
    hold = runner.parts.holds.start(lock, await index.find("t", "once"))
    turn = Turn(Tenant("t"), "once", "m", hold, Placement("e1", 0, Serve.LIVE), "http://e1", None, "header")  # type: ignore[arg-type]
    calls = []
    real = runner.finish

    async def counting(*args, **kwargs):
        calls.append(1)
        await real(*args, **kwargs)

    runner.finish = counting  # type: ignore[method-assign]
    svc = SimpleNamespace(runner=runner, metrics=runner.parts.metrics, settings=None)
    asked = Asked(svc, Tenant("t"), {}, "m", [], "/v1/chat/completions", None, None, [], None)  # type: ignore[arg-type]
    ending = Ending(SimpleNamespace(scope={}), asked, turn)  # type: ignore[arg-type]
    outcome = TurnOutcome(ok=True, usage={"prompt_tokens": 3}, timings={"prompt_n": 3})
    ending.answered(outcome)
    ending.ends(outcome)
    ending.answered(outcome)
    await runner.drain()
    assert calls == [1]
    assert runner.parts.metrics.prompt_tokens.labels("evaluated")._value.get() == 3  # counted once
    assert await locks.owner("t", "once") is None and await index.is_idle("t", "once")

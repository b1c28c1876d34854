"""The node's restore gate: restores start while their bytes in flight fit the budget, the others
wait in arrival order, one larger than the budget runs alone, and a cancelled waiter gives its
place (and any bytes granted meanwhile) back; the node agent's fills go through it."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from support.node_pair import handoff_body, until

from engine_pool.pool.agent import NodeAgent, NodeParts
from engine_pool.pool.restore_gate import RestoreGate, admits
from engine_pool.pool.settings import NodeSettings
from engine_pool.pool.supervisor import State
from engine_pool.protocol.handoff import HandoffRequest
from storage.blobs.spillcache import SpillCache
from storage.ids import SlotRef


@pytest.mark.parametrize(
    ("in_flight", "n", "budget", "expected"),
    [
        (0, 10, 100, True),
        (90, 10, 100, True),  # exactly the budget
        (91, 10, 100, False),
        (0, 500, 100, True),  # larger than the budget: alone
        (1, 500, 100, False),
        (10**12, 10**12, 0, True),  # budget 0: no bound
    ],
)
def test_admits(in_flight: int, n: int, budget: int, expected: bool) -> None:
    assert admits(in_flight, n, budget) is expected


def test_a_negative_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="-1 bytes"):
        RestoreGate(-1)


class Restores:
    """Restores through one gate, each held open until the test releases it."""

    def __init__(self, gate: RestoreGate) -> None:
        self.gate = gate
        self.started: list[str] = []
        self.waited: dict[str, float] = {}
        self._release: dict[str, asyncio.Event] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, name: str, n: int) -> asyncio.Task[None]:
        self._release[name] = asyncio.Event()

        async def run() -> None:
            async with self.gate.admit(n) as waited:
                self.started.append(name)
                self.waited[name] = waited
                await self._release[name].wait()

        self._tasks[name] = task = asyncio.create_task(run())
        return task

    async def settle(self) -> None:
        """Until every task that can run has run up to where it waits."""
        for _ in range(5):
            await asyncio.sleep(0)

    async def finish(self, name: str) -> None:
        self._release[name].set()
        await self._tasks[name]
        await self.settle()


async def test_restores_wait_in_order_while_their_bytes_do_not_fit() -> None:
    gate = RestoreGate(100)
    r = Restores(gate)
    r.start("a", 60)
    r.start("b", 40)
    await r.settle()
    assert r.started == ["a", "b"] and gate.in_flight == 100 and r.waited == {"a": 0.0, "b": 0.0}
    r.start("big", 80)
    r.start("small", 1)  # would fit beside nothing either: it waits behind big, never overtakes it
    await r.settle()
    assert r.started == ["a", "b"] and gate.waiting == 2
    await r.finish("a")
    assert r.started == ["a", "b"] and gate.in_flight == 40  # big needs 80: 40 + 80 > 100
    await r.finish("b")
    assert r.started == ["a", "b", "big", "small"] and gate.in_flight == 81 and gate.waiting == 0
    assert r.waited["big"] > 0 and r.waited["small"] > 0
    await r.finish("big")
    await r.finish("small")
    assert gate.in_flight == 0


async def test_a_restore_larger_than_the_budget_runs_alone() -> None:
    gate = RestoreGate(100)
    r = Restores(gate)
    r.start("small", 10)
    r.start("huge", 1000)
    await r.settle()
    assert r.started == ["small"]
    await r.finish("small")
    assert r.started == ["small", "huge"] and gate.in_flight == 1000
    r.start("next", 1)
    await r.settle()
    assert r.started == ["small", "huge"]  # nothing beside the one that is over the budget
    await r.finish("huge")
    assert r.started == ["small", "huge", "next"]
    await r.finish("next")
    assert gate.in_flight == 0


async def test_a_cancelled_waiter_gives_its_place_back() -> None:
    gate = RestoreGate(100)
    r = Restores(gate)
    r.start("a", 90)
    big = r.start("big", 50)
    r.start("c", 10)
    await r.settle()
    assert r.started == ["a"] and gate.waiting == 2
    big.cancel()  # the client left: big goes, c (which fits beside a) starts
    await r.settle()
    assert big.cancelled() and r.started == ["a", "c"] and gate.in_flight == 100 and gate.waiting == 0
    await r.finish("a")
    await r.finish("c")
    assert gate.in_flight == 0


async def test_a_waiter_cancelled_as_it_is_granted_gives_its_bytes_back() -> None:
    gate = RestoreGate(100)
    r = Restores(gate)
    r.start("a", 100)
    late = r.start("late", 50)
    await r.settle()
    r._release["a"].set()
    await r._tasks["a"]  # a's exit granted late's bytes; late has not run since
    assert gate.in_flight == 50
    late.cancel()
    await r.settle()
    assert late.cancelled() and gate.in_flight == 0 and gate.waiting == 0


async def test_an_unbounded_gate_never_waits() -> None:
    gate = RestoreGate(0)
    r = Restores(gate)
    for i in range(5):
        r.start(f"r{i}", 10**12)
    await r.settle()
    assert len(r.started) == 5 and set(r.waited.values()) == {0.0}
    for i in range(5):
        await r.finish(f"r{i}")
    assert gate.in_flight == 0


# -- the node agent's fills ------------------------------------------------------------------------
class _HeldStore:
    """A store whose fetches wait until the test lets them go (``size`` bytes each)."""

    def __init__(self, size: int) -> None:
        self.size, self.go = size, asyncio.Event()
        self.fetching: list[str] = []
        self.heads = 0
        self.blocks, self.read_outside = 0, 0  # `one_read` blocks open; reads made with none open

    @contextlib.contextmanager
    def one_read(self) -> Iterator[None]:
        self.blocks += 1
        try:
            yield
        finally:
            self.blocks -= 1

    async def head(self, ref: SlotRef) -> Any:
        self.heads += 1
        self.read_outside += not self.blocks
        return SimpleNamespace(size=self.size)

    async def get_to_file(self, ref: SlotRef, dest: Path, *, verify: bool = True) -> Any:
        self.read_outside += not self.blocks
        self.fetching.append(ref.session)
        await self.go.wait()
        await asyncio.to_thread(Path(dest).write_bytes, b"x" * self.size)


def _engine(slot_dir: Path) -> Any:
    """An engine's supervisor as the fill sees it; its restores answer at once."""

    def restore(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert (slot_dir / body["filename"]).stat().st_size == 1000
        slot = int(request.url.path.rsplit("/", 1)[1])
        timings = {"restore_ms": 1.0}
        answer = {"id_slot": slot, "filename": body["filename"], "n_restored": 7, "n_read": 1000}
        return httpx.Response(200, json={**answer, "n_checkpoints": 0, "timings": timings})

    sup = SimpleNamespace(spec=SimpleNamespace(engine_id="n1-e0", slot_dir=slot_dir), url="http://engine")
    return sup, httpx.AsyncClient(transport=httpx.MockTransport(restore))


@pytest.mark.parametrize("budget", [1500, 0])
async def test_the_node_fills_within_its_restore_budget(tmp_path: Path, budget: int) -> None:
    """Two fills of 1,000 bytes each: within 1,500 bytes the second waits until the first has
    restored (its fetch starts only then); unbounded, both fetch at once."""
    store, cache = _HeldStore(1000), await SpillCache.open(tmp_path / "cache", max_bytes=1 << 30)
    (slot_dir := tmp_path / "slots").mkdir()
    sup, http = _engine(slot_dir)
    parts = NodeParts(store=store, cache=cache, index=None, registry=None, http=http)  # type: ignore[arg-type]
    agent = NodeAgent(NodeSettings(models=(), restore_bytes_in_flight=budget), parts)
    fills = [
        asyncio.create_task(agent.filler.fill(sup, slot, SlotRef("t1", session, 1)))
        for slot, session in enumerate(["s1", "s2"])
    ]

    async def started() -> bool:  # the second waits at the gate, or both fetch
        return agent.restores.waiting == 1 if budget else len(store.fetching) == 2

    await until(started, 10)
    assert sorted(store.fetching) == (["s1"] if budget else ["s1", "s2"])
    assert agent.restores.waiting == (1 if budget else 0)
    assert agent.restores.in_flight == (1000 if budget else 0)
    store.go.set()
    done = await asyncio.wait_for(asyncio.gather(*fills), 10)
    assert [(f.tokens, f.bytes, f.source) for f in done] == [(7, 1000, "store")] * 2
    assert agent.restores.in_flight == 0 and agent.restores.waiting == 0
    assert store.heads == (2 if budget else 0)  # the size is read only when it matters
    assert store.read_outside == 0 and store.blocks == 0  # each fill's reads in a block of its own
    waited = agent.metrics.restores_waited._value.get()
    assert waited == (1 if budget else 0)
    await http.aclose()


class _HandedStore(_HeldStore):
    """A store that also holds handed-off states (``size`` bytes each), handed over at once."""

    prefix = "p"

    async def get_object_file(self, key: str, dest: Path) -> int:
        await asyncio.to_thread(Path(dest).write_bytes, b"x" * self.size)
        return self.size


async def test_a_handoff_install_waits_for_the_restore_budget(tmp_path: Path) -> None:
    """A handed-off state installed into a slot holds its bytes as a fill does: while a fill of
    1,000 bytes is under way, a handoff of 1,000 bytes within 1,500 waits for it — the handed state
    is on this disk, the engine not yet asked — and installs once the fill has restored."""
    store, cache = _HandedStore(1000), await SpillCache.open(tmp_path / "cache", max_bytes=1 << 30)
    (slot_dir := tmp_path / "slots").mkdir()
    sup, http = _engine(slot_dir)
    sup.spec.n_slots, sup.spec.model_id, sup.state = 2, "m", State.READY
    parts = NodeParts(store=store, cache=cache, index=None, registry=None, http=http)  # type: ignore[arg-type]
    agent = NodeAgent(NodeSettings(models=(), restore_bytes_in_flight=1500), parts)
    agent.engines["n1-e0"] = sup
    fill = asyncio.create_task(agent.filler.fill(sup, 0, SlotRef("t1", "s1", 1)))
    await until(lambda: _true(store.fetching == ["s1"]), 10)
    req = HandoffRequest("t1", "s2", "n2-e0", handoff_body("s2"), from_store=f".handoffs/{'ab' * 16}.slot")
    handoff = asyncio.create_task(agent.handoff("n1-e0", "1", req))
    await until(lambda: _true(agent.restores.waiting == 1), 10)
    assert [p.name.startswith("handoff-") for p in slot_dir.iterdir()] == [True]  # fetched, not installed
    store.go.set()
    filled, handed = await asyncio.wait_for(asyncio.gather(fill, handoff), 10)
    assert (filled.source, handed.through_store, handed.bytes) == ("store", True, 1000)
    assert agent.restores.in_flight == 0 and agent.restores.waiting == 0
    assert agent.metrics.restores_waited._value.get() == 1
    await http.aclose()


async def _true(value: bool) -> bool:
    return value

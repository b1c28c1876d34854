"""The engine's safety at the Python boundary: a fault in the loop, close() from several threads,
a configuration nobody can change under the running loop.

Faults are real: `_inject_fault_for_tests` makes the loop thread itself throw std::bad_alloc (at the
top of an iteration, or inside a checkpoint capture in the middle of a step), so the C++ handler
under test is the one production runs.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import native

TEXT = "It was a bright cold day in April, and the clocks were striking thirteen. " * 6
DEADLINE_S = 20.0  # generous: a stuck loop fails the test instead of hanging it


def run_threads(fns: list[Callable[[], object]]) -> list[BaseException | None]:
    """Run each fn on its own thread, released together; each one's exception (or None), in order."""
    start = threading.Barrier(len(fns))
    outcome: list[BaseException | None] = [None] * len(fns)

    def body(i: int) -> None:
        start.wait()
        try:
            fns[i]()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            outcome[i] = exc

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    stuck = [t.name for t in threads if t.is_alive()]
    assert not stuck, f"threads still blocked after {DEADLINE_S} s: {stuck}"
    return outcome


def first_token(eng: native.Engine, request_id: int) -> None:
    """Block until `request_id` has produced a token (it is running in its slot)."""
    sink = eng._sinks[request_id]
    deadline = time.monotonic() + DEADLINE_S
    while not any(ev.kind == "token" for ev in sink.events):
        assert not sink.done, f"request {request_id} ended before its first token"
        assert time.monotonic() < deadline, f"request {request_id} produced no token in {DEADLINE_S} s"
        eng._route(eng.raw.wait(0.1))  # blocks until the loop pushes events (routed like collect)


# -- faults -------------------------------------------------------------------------------------


def test_a_fault_ends_running_and_queued_requests_and_closes_the_engine(make_engine, greedy, tmp_path: Path):
    eng = make_engine("qwen35")
    a = eng.tokenize(TEXT)
    running = eng.submit(0, greedy(a, -1, ignore_eos=True))
    queued = eng.submit(0, greedy(a, 4))  # waits behind `running` for the same slot
    first_token(eng, running)

    eng.raw._inject_fault_for_tests("command")

    for rid in (running, queued):
        with pytest.raises(native.NativeError, match=r"the engine failed: std::bad_alloc"):
            eng.collect(rid, timeout_s=DEADLINE_S)
    # Closed before the first error event went out: no caller can slip a request in after it.
    assert eng.closed and eng.fault == "std::bad_alloc"
    refused = [
        lambda: eng.submit(0, greedy(a, 2)),
        lambda: eng.slots(),
        lambda: eng.cancel(running),
        lambda: eng.erase_slot(0),
        lambda: eng.save_slot(0, str(tmp_path / "x.slot")),
        lambda: eng.raw._inject_fault_for_tests("command"),
    ]
    for call in refused:
        with pytest.raises(native.EngineClosedError, match=r"its loop failed \(std::bad_alloc\)"):
            call()
    eng.raw.cancel_nowait(running)  # cleanup code must still be able to call it
    # What needs no loop keeps working: the model stays loaded until the object goes.
    assert eng.tokenize("clocks")
    eng.close()
    eng.close()


def test_a_fault_inside_a_checkpoint_capture_mid_step(make_engine, greedy):
    # qwen35 is hybrid: a prompt this long plans a checkpoint every 96 tokens, captured in step()
    # between decoding a chunk and sampling.
    eng = make_engine("qwen35")
    a = eng.tokenize(TEXT * 2)
    assert len(a) > 96
    eng.raw._inject_fault_for_tests("checkpoint")
    with pytest.raises(native.NativeError, match="the engine failed: std::bad_alloc"):
        eng.generate(0, greedy(a, 8), timeout_s=DEADLINE_S)
    assert eng.fault == "std::bad_alloc"
    assert eng.metrics().get("checkpoints_created", 0) == 0
    with pytest.raises(native.EngineClosedError):
        eng.generate(0, greedy(a, 8))


def test_callers_waiting_on_the_loop_get_an_error_not_a_hang(make_engine, greedy):
    eng = make_engine("qwen35", n_slots=2)
    rid = eng.submit(0, greedy(eng.tokenize(TEXT), -1, ignore_eos=True))
    first_token(eng, rid)

    def keep_asking() -> None:
        # call() after call(): the fault lands while one of them waits for the loop (its command
        # is dropped unrun) or the next one is refused at once; either way it ends.
        while True:
            eng.slots()
            eng.slot_tokens(1)

    outcome = run_threads([keep_asking] * 3 + [lambda: eng.raw._inject_fault_for_tests("command")])
    assert outcome[3] is None
    for exc in outcome[:3]:
        assert isinstance(exc, native.EngineClosedError) and "std::bad_alloc" in str(exc), exc
    with pytest.raises(native.NativeError, match="std::bad_alloc"):
        eng.collect(rid, timeout_s=DEADLINE_S)


async def test_a_fault_ends_streams_and_reaches_on_fault(make_engine, greedy):
    eng = make_engine("qwen35", n_slots=2)
    a = eng.tokenize(TEXT)
    reasons: list[str] = []
    faulted = asyncio.Event()

    def on_fault(reason: str) -> None:
        reasons.append(reason)
        faulted.set()

    eng.on_fault(on_fault)
    running = [asyncio.Event(), asyncio.Event()]

    async def consume(slot: int) -> list[native.Event]:
        events = []
        async for ev in eng.stream(slot, greedy(a, -1, ignore_eos=True)):
            events.append(ev)
            running[slot].set()
        return events

    tasks = [asyncio.create_task(consume(s)) for s in (0, 1)]
    await asyncio.wait_for(asyncio.gather(*(r.wait() for r in running)), DEADLINE_S)
    eng.raw._inject_fault_for_tests("command")
    for events in await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S):
        assert events[-1].kind == "error" and "std::bad_alloc" in events[-1].message
        assert {ev.kind for ev in events[:-1]} == {"token"}
    await asyncio.wait_for(faulted.wait(), DEADLINE_S)
    assert reasons == ["std::bad_alloc"]  # once, however many requests failed
    with pytest.raises(native.EngineClosedError):
        async for _ in eng.stream(0, greedy(a, 2)):
            pass
    late: list[str] = []
    told = asyncio.Event()

    def on_late_fault(reason: str) -> None:
        late.append(reason)
        told.set()

    eng.on_fault(on_late_fault)  # registered after the fault was seen: still told, soon
    await asyncio.wait_for(told.wait(), DEADLINE_S)
    assert late == ["std::bad_alloc"]
    eng.close()
    assert not asyncio.get_running_loop().remove_reader(eng.raw.event_fd())


# -- close --------------------------------------------------------------------------------------


def test_close_from_several_threads_at_once(make_engine, greedy):
    eng = make_engine("qwen35")
    rid = eng.submit(0, greedy(eng.tokenize(TEXT), -1, ignore_eos=True))
    first_token(eng, rid)
    assert run_threads([eng.raw.close] * 8) == [None] * 8
    assert eng.raw.closed and eng.fault == ""
    with pytest.raises(native.NativeError, match="shutting down"):
        eng.collect(rid, timeout_s=DEADLINE_S)
    assert run_threads([eng.close] * 8) == [None] * 8  # the facade, too, on a closed core
    eng.raw.close()


def test_close_twice_and_after_a_fault(make_engine, greedy):
    eng = make_engine("llama")
    eng.close()
    eng.close()
    eng.raw.close()
    with pytest.raises(native.EngineClosedError, match="the engine is closed$"):
        eng.submit(0, greedy([1, 2]))

    faulty = make_engine("llama")
    faulty.raw._inject_fault_for_tests("command")
    with pytest.raises(native.EngineClosedError, match="std::bad_alloc"):
        # The fault is in the command queue ahead of this call: refused, never left waiting.
        faulty.slots()
    # The loop thread has ended on its own; every close joins (or finds it joined) and returns.
    assert run_threads([faulty.close] * 4) == [None] * 4
    faulty.close()
    assert faulty.fault == "std::bad_alloc"


async def test_facade_close_from_threads_while_a_stream_runs(make_engine, greedy):
    eng = make_engine("qwen35", n_ctx=32768)  # room for a generation that outlasts the test
    a = eng.tokenize(TEXT)
    got_token = asyncio.Event()

    async def consume() -> list[str]:
        kinds = []
        async for ev in eng.stream(0, greedy(a, -1, ignore_eos=True)):
            kinds.append(ev.kind)
            got_token.set()
        return kinds

    task = asyncio.create_task(consume())
    await asyncio.wait_for(got_token.wait(), DEADLINE_S)
    # close() from worker threads: the core stops at once, the reader is detached on this loop.
    await asyncio.wait_for(asyncio.gather(*(asyncio.to_thread(eng.close) for _ in range(4))), DEADLINE_S)
    kinds = await asyncio.wait_for(task, DEADLINE_S)
    assert kinds[-1] == "error" and set(kinds[:-1]) == {"token"}
    # The first closer scheduled the detach before it returned, so it has run by now.
    assert not asyncio.get_running_loop().remove_reader(eng.raw.event_fd())
    with pytest.raises(native.EngineClosedError):
        async for _ in eng.stream(0, greedy(a, 2)):
            pass


# -- configuration and parameters ---------------------------------------------------------------


def test_config_cannot_be_changed_under_the_running_engine(make_engine, greedy):
    eng = make_engine("llama", n_slots=2)
    with pytest.raises(AttributeError):
        eng.config.n_slots = 99  # type: ignore[misc]
    copy = eng.config
    assert copy is not eng.config and copy.n_slots == 2
    # The loop and check_slot_id still see two slots: a slot past the end is refused precisely.
    with pytest.raises(
        native.InvalidRequestError, match=r"slot 5 does not exist \(this engine has slots 0\.\.1\)"
    ):
        eng.submit(5, greedy([1, 2]))
    with pytest.raises(native.InvalidRequestError, match="slot 2 does not exist"):
        eng.erase_slot(2)
    assert [s.id for s in eng.slots()] == [0, 1]
    assert eng.generate(1, greedy([1, 2, 3], 2)).slot == 1


def test_request_params_are_copied_at_submit(make_engine, greedy):
    eng = make_engine("qwen35")
    a = eng.tokenize(TEXT)
    want = eng.generate(0, greedy(a, 4)).tokens
    p = greedy(a, 4)
    rid = eng.submit(0, p)
    p.n_predict = 500  # after submit: the queued request keeps what it was given
    p.prompt = [1]
    p.stop_tokens = [want[0]]
    got = eng.collect(rid, timeout_s=DEADLINE_S)
    assert got.tokens == want and got.stop_reason == "length"


def test_unknown_fault_site_is_refused(make_engine):
    eng = make_engine("llama")
    with pytest.raises(native.InvalidRequestError, match="unknown fault site"):
        eng.raw._inject_fault_for_tests("nowhere")
    assert not eng.closed

"""Engine behaviour at the Python boundary: slot isolation, batching, requests, errors."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import native
from storage.slotfile.reader import read_slot_file

TEXT = "It was a bright cold day in April, and the clocks were striking thirteen. " * 6


@pytest.mark.parametrize("arch", ["qwen35", "llama", "mamba2"])
def test_concurrent_slots_match_solo_runs(arch, make_engine, greedy):
    solo = make_engine(arch, n_slots=2)
    a = solo.tokenize(TEXT)
    b = solo.tokenize("Call me Ishmael. Some years ago, never mind how long precisely. " * 5)
    want_a = solo.generate(0, greedy(a, 16)).tokens
    want_b = solo.generate(1, greedy(b, 16)).tokens

    both = make_engine(arch, n_slots=2)
    ra = both.submit(0, greedy(a, 16))
    rb = both.submit(1, greedy(b, 16))  # batched with slot 0: prefill chunks and decode tokens
    assert both.collect(ra).tokens == want_a
    assert both.collect(rb).tokens == want_b


def test_restore_into_one_slot_does_not_disturb_another(make_engine, greedy, tmp_path: Path):
    eng = make_engine("qwen35", n_slots=2)
    a = eng.tokenize(TEXT)
    b = eng.tokenize("Call me Ishmael. " * 12)
    eng.generate(1, greedy(b, 4))
    path = tmp_path / "b.slot"
    eng.save_slot(1, str(path))
    want_a = eng.generate(0, greedy(a, 40)).tokens
    want_b = eng.generate(1, greedy(b + [5, 6, 7], 8)).tokens
    eng.erase_slot(0)
    eng.erase_slot(1)

    running = eng.submit(0, greedy(a, 40))  # slot 0 generates while slot 1 is restored
    eng.restore_slot(1, str(path))
    assert eng.collect(running).tokens == want_a
    got_b = eng.generate(1, greedy(b + [5, 6, 7], 8))
    assert got_b.tokens == want_b and got_b.timings.restored and got_b.timings.prompt_n == 3


def test_a_snapshot_is_written_as_it_was_taken_while_the_slot_goes_on(make_engine, greedy, tmp_path: Path):
    """A save copies the slot's state (snapshot_slot) and writes it afterwards (write_snapshot):
    the slot serves the session's next turn meanwhile, and the file is the state at the copy —
    the bytes a save at that moment writes, which restore to the live turn's answer."""
    eng = make_engine("qwen35")
    eng.generate(0, greedy(eng.tokenize(TEXT), 4))
    snapshot = eng.snapshot_slot(0)
    at_copy = eng.slot_tokens(0)
    eng.save_slot(0, str(tmp_path / "whole.slot"))
    nxt = at_copy + [5, 6, 7]
    running = eng.submit(0, greedy(nxt, 8))  # the next turn, while the snapshot is written
    info = eng.write_snapshot(snapshot, str(tmp_path / "snap.slot"))
    live = eng.collect(running)
    assert (snapshot.slot, snapshot.n_tokens, info.n_tokens) == (0, len(at_copy), len(at_copy))
    assert _state_bytes(tmp_path / "snap.slot") == _state_bytes(tmp_path / "whole.slot")
    eng.restore_slot(0, str(tmp_path / "snap.slot"))
    got = eng.generate(0, greedy(nxt, 8))
    assert got.tokens == live.tokens and got.timings.restored
    assert got.timings.prompt_n == live.timings.prompt_n == 3


def test_a_snapshot_keeps_the_checkpoints_the_slot_drops(make_engine, greedy, tmp_path: Path):
    """A snapshot shares the slot's checkpoints instead of copying them: a turn that leaves the
    session early drops the checkpoints past where it leaves, and the snapshot written after it
    still holds them all, byte for byte."""
    eng = make_engine("qwen35")
    eng.generate(0, greedy(eng.tokenize(TEXT), 4))
    before = eng.slots()[0].n_checkpoints
    snapshot = eng.snapshot_slot(0)
    at_copy = eng.slot_tokens(0)
    eng.save_slot(0, str(tmp_path / "whole.slot"))
    eng.generate(0, greedy(at_copy[:20] + [5, 6, 7], 2))  # drops the checkpoints past token 20
    assert eng.slots()[0].n_checkpoints < before
    eng.write_snapshot(snapshot, str(tmp_path / "snap.slot"))
    assert len(read_slot_file(tmp_path / "snap.slot").checkpoints) == before >= 2
    assert _state_bytes(tmp_path / "snap.slot") == _state_bytes(tmp_path / "whole.slot")


def _state_bytes(path: Path) -> tuple[bytes, bytes]:
    """Tokens and state, and the checkpoints, of a slot file (its metadata says when it was made)."""
    sf, data = read_slot_file(path), path.read_bytes()
    return data[: sf.base_len], data[sf.ckpt_offset : sf.ckpt_offset + sf.ckpt_len]


def test_slot_choice_prefers_longest_prefix_then_lru(make_engine, greedy):
    eng = make_engine("llama", n_slots=3)
    a = eng.tokenize(TEXT)
    b = eng.tokenize("Call me Ishmael. " * 12)
    eng.generate(1, greedy(a, 2))
    eng.generate(2, greedy(b, 2))
    got = eng.generate(-1, greedy(a + [9, 9], 2))
    assert got.slot == 1 and got.timings.cache_n > 0
    fresh = eng.generate(-1, greedy(eng.tokenize("Something unrelated"), 2))
    assert fresh.slot == 0  # never used: the least recently used


def test_requests_for_a_busy_slot_wait_their_turn(make_engine, greedy):
    eng = make_engine("qwen35")
    a = eng.tokenize(TEXT)
    first = eng.submit(0, greedy(a, 20))
    second = eng.submit(0, greedy(a, 5))
    assert [s.queued for s in eng.slots()] == [1] or eng.slots()[0].busy
    one = eng.collect(first)
    two = eng.collect(second)
    assert len(one.tokens) == 20 and two.tokens == one.tokens[:5]
    assert two.timings.cache_n > 0


def test_cancel_running_and_queued(make_engine, greedy):
    eng = make_engine("qwen35")
    a = eng.tokenize(TEXT)
    running = eng.submit(0, greedy(a, -1, ignore_eos=True))
    queued = eng.submit(0, greedy(a, 4))
    assert eng.cancel(queued)
    assert eng.cancel(running)
    assert eng.collect(queued).stop_reason == "cancelled"
    assert eng.collect(running).stop_reason == "cancelled"
    assert not eng.cancel(running)
    assert eng.generate(0, greedy(a, 3)).stop_reason == "length"


def test_stop_tokens_eos_and_prompt_only(make_engine, greedy):
    eng = make_engine("qwen35")
    a = eng.tokenize(TEXT)
    free = eng.generate(0, greedy(a, 12))
    stop = free.tokens[5]
    first = free.tokens.index(stop)
    got = eng.generate(0, greedy(a, 12, stop_tokens=[stop]))
    assert got.stop_reason == "stop_token" and got.tokens == free.tokens[:first]
    # Bias the end-of-turn token up: generation ends with "eos", the token itself is not emitted.
    eot = eng.model.eot
    done = eng.generate(0, greedy(a, 12, logit_bias={eot: 100.0}))
    assert done.stop_reason == "eos" and done.tokens == []
    prefill = eng.generate(0, greedy(a + [7], 0))
    assert prefill.tokens == [] and prefill.timings.prompt_n == 1


def test_seeded_sampling_is_reproducible(make_engine, greedy):
    eng = make_engine("lfm2")
    a = eng.tokenize(TEXT)
    p = greedy(a, 16, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    one = eng.generate(0, p).tokens
    eng.erase_slot(0)
    assert eng.generate(0, p).tokens == one
    p.seed = 99
    assert eng.generate(0, p).tokens != one


def test_grammar_constrains_output(make_engine, greedy):
    eng = make_engine("qwen35")
    got = eng.generate(0, greedy(eng.tokenize(TEXT), 8, grammar='root ::= "yes" | "no"'))
    assert got.text in ("yes", "no") and got.stop_reason == "eos"


def test_bad_requests_are_refused_precisely(make_engine, greedy):
    eng = make_engine("llama", n_slots=2)
    cases = [
        (lambda: eng.submit(5, greedy([1, 2])), "slot 5 does not exist"),
        (lambda: eng.submit(0, greedy([])), "the prompt is empty"),
        (lambda: eng.submit(0, greedy([1] * 2000)), "2000 tokens"),
        (lambda: eng.submit(0, greedy([1, 10**6])), "outside the vocabulary"),
        (lambda: eng.submit(0, greedy([1, 2], stop_tokens=[-3])), "stop token -3"),
        (lambda: eng.submit(0, greedy([1, 2], logit_bias={10**6: 1.0})), "logit_bias"),
        (lambda: eng.submit(0, greedy([1, 2], grammar='root ::= "open')), "grammar"),
        (lambda: eng.erase_slot(-1), "slot -1"),
    ]
    for call, message in cases:
        with pytest.raises(native.InvalidRequestError, match=message):
            call()
    assert eng.generate(0, greedy([1, 2, 3], 2)).tokens


def test_busy_slot_cannot_be_saved_and_closed_engine_refuses(make_engine, greedy, tmp_path: Path):
    eng = make_engine("qwen35")
    rid = eng.submit(0, greedy(eng.tokenize(TEXT), -1, ignore_eos=True))
    with pytest.raises(native.SlotBusyError):
        eng.save_slot(0, str(tmp_path / "x.slot"))
    eng.cancel(rid)
    eng.collect(rid)
    eng.close()
    with pytest.raises(native.EngineClosedError):
        eng.submit(0, greedy([1, 2]))


def test_close_ends_running_requests_with_an_error(make_engine, greedy):
    eng = make_engine("qwen35")
    rid = eng.submit(0, greedy(eng.tokenize(TEXT), -1, ignore_eos=True))
    eng.raw.close()
    with pytest.raises(native.NativeError, match="shutting down"):
        eng.collect(rid, timeout_s=10)


async def test_async_stream_and_early_exit_cancels(make_engine, greedy):
    eng = make_engine("qwen35")
    a = eng.tokenize(TEXT)
    events = [ev async for ev in eng.stream(0, greedy(a, 6))]
    assert [e.kind for e in events] == ["token"] * 6 + ["done"]
    assert events[-1].timings.predicted_n == 6

    async for ev in eng.stream(0, greedy(a, -1, ignore_eos=True)):
        assert ev.kind == "token"
        break  # leaving the iteration cancels the request
    for _ in range(50):
        if not eng.slots()[0].busy:
            break
        await asyncio.sleep(0.05)
    assert not eng.slots()[0].busy


async def test_progress_events_come_before_the_first_token(make_engine, greedy):
    """`report_progress`: one event when the prompt starts (what was reused), one per chunk
    (n_batch 32 here; a chunk also ends at a planned checkpoint), all before the first token; the
    identical prompt again has one, with every token cached. Without it, none."""
    eng = make_engine("qwen35", n_batch=32)
    prompt = eng.tokenize(TEXT)
    events = [
        ev async for ev in eng.stream(0, greedy(prompt, 3, report_progress=True, timings_per_token=True))
    ]
    progress = [e for e in events if e.kind == "progress"]
    first_token = next(i for i, e in enumerate(events) if e.kind == "token")
    assert all(e.kind == "progress" for e in events[:first_token]) and len(progress) == first_token
    done = [(e.timings.cache_n, e.timings.prompt_n) for e in progress]
    assert done[0] == (0, 0) and progress[0].timings.prompt_ms == 0.0
    assert done[-1] == (0, len(prompt)) and all(e.prompt_total == len(prompt) for e in progress)
    assert [n for _, n in done] == sorted(set(n for _, n in done))  # grows with every chunk
    assert len(progress) >= 1 + len(prompt) // 32
    tokens = [e for e in events if e.kind == "token"]
    assert [e.timings.predicted_n for e in tokens] == [1, 2, 3]  # timings_per_token
    again = [ev async for ev in eng.stream(0, greedy(prompt, 2, report_progress=True))]
    assert [e.kind for e in again] == ["progress", "token", "token", "done"]
    assert (again[0].timings.cache_n, again[0].timings.prompt_n) == (len(prompt), 0)
    plain = [ev.kind async for ev in eng.stream(0, greedy(prompt, 2))]
    assert plain == ["token", "token", "done"]


def test_the_ladder_keeps_geometric_spacing_toward_the_newest():
    """The pure choice: the newest and the opening (the oldest boundary) stay; else a prompt that leaves the
    state D tokens before the newest re-evaluates about D at most (the ladder thins far from the
    end, not near it); intervals go before message boundaries; the bytes bound holds too."""
    ladder = [(100 * (i + 1), "interval" if i % 3 else "prompt_end", 10) for i in range(60)]
    drop = set(native.checkpoints_to_evict(ladder, 8, 1 << 30))
    kept = [n for i, (n, _, _) in enumerate(ladder) if i not in drop]
    assert len(kept) == 8 and kept[0] == 100 and kept[-1] == 6000
    newest = kept[-1]
    for x in range(kept[0], newest + 1, 50):
        rollback = max(n for n in kept if n <= x)
        assert x - rollback <= (newest - x) + 128, (x, kept)
    # A long system prompt and tools: intervals inside it go, the boundary where it ends stays.
    opening = [(2048 * (i + 1), "interval", 1) for i in range(9)] + [(20000, "hint", 1)]
    session = opening + [(20000 + 1000 * t, "prompt_end", 1) for t in range(1, 80)]
    drop = set(native.checkpoints_to_evict(session, 8, 1 << 30))
    kept = [n for i, (n, _, _) in enumerate(session) if i not in drop]
    assert 20000 in kept and kept[-1] == 99000 and not any(n < 20000 for n in kept), kept
    # At equal spacing, an interval goes first.
    even = [(100, "hint", 1), (200, "interval", 1), (300, "prompt_end", 1), (400, "prompt_end", 1)]
    assert native.checkpoints_to_evict(even, 3, 1 << 30) == [1]
    # Bytes: the interior first, then the oldest, the newest last.
    assert native.checkpoints_to_evict(even, 10, 2) == [1, 2]
    assert native.checkpoints_to_evict(even, 10, 1) == [0, 1, 2]
    assert native.checkpoints_to_evict(even, 0, 1 << 30) == [0, 1, 2, 3]


def test_a_slot_file_keeps_the_stored_ladder_and_the_slot_keeps_its_own(make_engine, greedy, tmp_path: Path):
    """`max_stored_checkpoints`: the file holds at most that many of the slot's checkpoints, the
    newest among them (so the identical prompt still costs nothing after a restore), while the slot
    keeps its whole ladder."""
    eng = make_engine("qwen35", max_stored_checkpoints=3, checkpoint_interval=16, checkpoint_min_step=8)
    prompt = eng.tokenize(TEXT * 2)
    eng.generate(0, greedy(prompt, 2))
    assert eng.slots()[0].n_checkpoints > 3
    info = eng.save_slot(0, str(tmp_path / "s.slot"))
    stored = read_slot_file(tmp_path / "s.slot").checkpoints
    assert info.n_checkpoints == len(stored) == 3 and eng.metrics()["checkpoints_not_stored"] > 0
    assert stored[-1].n_tokens == len(prompt)
    assert eng.slots()[0].n_checkpoints > 3
    fresh = make_engine("qwen35", max_stored_checkpoints=3)
    fresh.restore_slot(0, str(tmp_path / "s.slot"))
    assert fresh.generate(0, greedy(prompt, 2)).timings.prompt_n == 0


def test_checkpoints_are_bounded_per_slot(make_engine, greedy):
    eng = make_engine("qwen35", max_checkpoints=3, checkpoint_interval=32, checkpoint_min_step=8)
    a = eng.tokenize(TEXT * 2)
    eng.generate(0, greedy(a, 2))
    info = eng.slots()[0]
    assert info.n_checkpoints == 3
    assert eng.metrics()["checkpoints_evicted"] > 0
    # The prompt end survives eviction: the identical prompt still costs nothing.
    assert eng.generate(0, greedy(a, 2)).timings.prompt_n == 0
    small = make_engine("qwen35", max_checkpoint_bytes=1)
    small.generate(0, greedy(a, 2))
    assert small.slots()[0].n_checkpoints == 0


def test_a_hint_just_before_the_prompt_end_stands_for_the_prompt_end(make_engine, greedy):
    """A chat turn's next-turn hint lies a few tokens before its prompt end (two for a template that
    opens reasoning in its generation prompt): the slot keeps that one state, not a second at the
    prompt end; an identical retry evaluates the few tokens from it and answers the same. A hint
    further back leaves the prompt end its own checkpoint (an identical retry costs nothing)."""
    eng = make_engine("qwen35", checkpoint_interval=0)
    a = eng.tokenize(TEXT)
    first = eng.generate(0, greedy(a, 4, checkpoint_hints=[len(a) - 2]))
    assert eng.slots()[0].n_checkpoints == 1
    again = eng.generate(0, greedy(a, 4, checkpoint_hints=[len(a) - 2]))
    assert (again.timings.prompt_n, again.tokens) == (2, first.tokens)
    assert eng.slots()[0].n_checkpoints == 1

    far = make_engine("qwen35", checkpoint_interval=0)
    far.generate(0, greedy(a, 4, checkpoint_hints=[len(a) - 9]))
    assert far.slots()[0].n_checkpoints == 2
    assert far.generate(0, greedy(a, 4, checkpoint_hints=[len(a) - 9])).timings.prompt_n == 0


def test_a_hint_just_after_another_checkpoint_yields_to_it(make_engine, greedy):
    """The start of the last user message a few tokens after the previous turn's checkpoint (a short
    reply between them) is not captured: an edit of that message evaluates the reply again. Hints
    at least --checkpoint-min-step apart are all kept, and so is the one standing for the prompt end."""
    a = make_engine("qwen35").tokenize(TEXT * 4)
    assert len(a) > 380
    hints = [100, 120, 300, len(a) - 2]
    for min_step, kept in ((64, [100, 300, len(a) - 2]), (0, hints)):
        eng = make_engine("qwen35", checkpoint_interval=0, checkpoint_min_step=min_step)
        eng.generate(0, greedy(a, 2, checkpoint_hints=hints))
        assert eng.slots()[0].n_checkpoints == len(kept), min_step
        for at in kept:  # each is where a prompt diverging right after it restarts
            b = a[: at + 1] + [a[at + 1] + 1]
            assert eng.generate(0, greedy(b, 1, checkpoint_hints=hints)).timings.cache_n == at
            eng.generate(0, greedy(a, 2, checkpoint_hints=hints))


def test_one_libllama_per_process(make_engine):
    make_engine("qwen35")
    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if "libllama.so" in line}
    assert len(libs) == 1, libs


async def test_cancelled_consumer_task_cancels_its_request_and_close_ends_streams(make_engine, greedy):
    eng = make_engine("qwen35", n_ctx=32768)  # room for a generation that outlasts the test
    a = eng.tokenize(TEXT)

    async def consume() -> list[str]:
        return [ev.kind async for ev in eng.stream(0, greedy(a, -1, ignore_eos=True))]

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    task.cancel()  # a client disconnecting from a server: the request must not run on
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(50):
        if not eng.slots()[0].busy:
            break
        await asyncio.sleep(0.05)
    assert not eng.slots()[0].busy

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.2)
    eng.close()
    kinds = await asyncio.wait_for(task, 5)
    assert kinds[-1] == "error"


def test_a_load_reports_its_progress_by_tenths(tiny_model):
    heard: list[float] = []
    eng = native.Engine(native.EngineConfig(tiny_model("qwen35"), n_ctx=256), heard.append)
    eng.close()
    assert heard and heard == sorted(heard) and heard[-1] == 1.0
    assert len({int(p * 10) for p in heard}) == len(heard) <= 11  # each tenth once


def test_a_progress_listener_that_raises_does_not_stop_the_load(tiny_model):
    def broken(_: float) -> None:
        raise RuntimeError("a listener's own bug")

    eng = native.Engine(native.EngineConfig(tiny_model("qwen35"), n_ctx=256), broken)
    assert eng.model.n_vocab > 0
    eng.close()

"""A request starting from another slot's state (`RequestParams.prefix_sources`): a new session
whose prompt shares its system prompt with a session in another slot evaluates only what is its
own, and gives the same tokens as the same prompt evaluated from scratch; the source slot is left
as it was, and the copy saves and restores like any slot."""

from __future__ import annotations

from pathlib import Path

import pytest

SYSTEM = [1 + (i * 7919) % 200 for i in range(160)]  # a shared prefix (a system prompt and tools)
FIRST = [3 + (i * 31) % 97 for i in range(40)]  # one session's own first message
SECOND = [5 + (i * 17) % 89 for i in range(40)]  # another's

# (arch, engine options): one KV stream (cells shared by the copy), a stream per slot (a state
# copy), the shared pool, a sliding window, a recurrent model, attention only.
ENGINES = [
    ("qwen35", {}),
    ("qwen35", {"kv_unified": True}),
    ("lfm2", {}),
    ("mamba2", {}),
    ("gemma2", {}),
    ("llama", {}),
]


def _warm(eng, greedy, slot: int = 0):
    """Slot `slot` holds a session of SYSTEM + FIRST, with a checkpoint where SYSTEM ends."""
    return eng.generate(slot, greedy(SYSTEM + FIRST, 6, checkpoint_hints=[len(SYSTEM)]))


@pytest.mark.parametrize(
    ("arch", "opts"), ENGINES, ids=[f"{a}{'-' + next(iter(o)) if o else ''}" for a, o in ENGINES]
)
def test_a_new_session_starts_from_another_slots_prefix_exactly(arch, opts, make_engine, greedy) -> None:
    eng = make_engine(arch, n_slots=3, **opts)
    first = _warm(eng, greedy)
    prompt = SYSTEM + SECOND
    got = eng.generate(2, greedy(prompt, 8, prefix_sources=[0, 1]))
    assert got.timings.source_slot == 0
    assert got.timings.cache_n == len(SYSTEM)  # the checkpoint (hybrid), the common prefix (others)
    assert got.timings.prompt_n == len(SECOND)
    assert (got.timings.candidate_slot, got.timings.common_n) == (0, len(SYSTEM))
    assert got.timings.candidate_n == len(SYSTEM + FIRST) + 5  # the prompt and what it generated
    assert got.timings.candidate_prompt_n == len(SYSTEM + FIRST)

    scratch = make_engine(arch, n_slots=3, **opts)
    expected = scratch.generate(2, greedy(prompt, 8))
    assert expected.timings.cache_n == 0
    assert got.tokens == expected.tokens

    # The source is as it was: its next turn continues from its own end.
    again = eng.generate(0, greedy(SYSTEM + FIRST + first.tokens[:5] + [7, 8], 4))
    assert again.timings.source_slot == -1 and again.timings.cache_n == len(SYSTEM + FIRST) + 5


def test_the_copy_saves_and_restores_like_any_slot(make_engine, greedy, tmp_path: Path) -> None:
    eng = make_engine("qwen35", n_slots=4)
    assert eng.kv_streams
    _warm(eng, greedy, slot=1)
    prompt = SYSTEM + SECOND
    got = eng.generate(3, greedy(prompt, 6, prefix_sources=[1]))
    assert got.timings.source_slot == 1
    path = tmp_path / "copy.slot"
    eng.save_slot(3, str(path))  # a save right after the copy's request: the copy is complete
    nxt = [*prompt, *got.tokens[:5], 9, 9]
    live = eng.generate(3, greedy(nxt, 6))
    other = make_engine("qwen35", n_slots=2)
    other.restore_slot(0, str(path))
    restored = other.generate(0, greedy(nxt, 6))
    assert restored.tokens == live.tokens and restored.timings.prompt_n == live.timings.prompt_n == 2


def test_no_copy_when_the_own_slot_serves_as_much_or_the_gain_is_small(make_engine, greedy) -> None:
    eng = make_engine("qwen35", n_slots=3)
    _warm(eng, greedy, slot=0)
    _warm(eng, greedy, slot=1)
    own = eng.generate(1, greedy(SYSTEM + FIRST + [4, 4], 2, prefix_sources=[0]))
    assert own.timings.source_slot == -1  # its own slot serves as much
    short = SYSTEM[:20] + SECOND  # 20 tokens in common: less than a copy is worth
    got = eng.generate(2, greedy(short, 2, prefix_sources=[0, 1]))
    assert got.timings.source_slot == -1 and got.timings.cache_n == 0
    assert got.timings.common_n == 20 and got.timings.candidate_slot in (0, 1)


def test_sources_out_of_range_and_the_own_slot_are_ignored(make_engine, greedy) -> None:
    eng = make_engine("qwen35", n_slots=2)
    _warm(eng, greedy, slot=0)
    got = eng.generate(1, greedy(SYSTEM + SECOND, 2, prefix_sources=[1, 7, -3, 0]))
    assert got.timings.source_slot == 0
    lone = make_engine("qwen35", n_slots=2)
    _warm(lone, greedy, slot=0)
    none = lone.generate(1, greedy(SYSTEM + SECOND, 2, prefix_sources=[]))
    assert none.timings.source_slot == -1 and none.timings.cache_n == 0


def test_a_busy_source_is_copied_as_it_stands(make_engine, greedy) -> None:
    eng = make_engine("qwen35", n_slots=2)
    running = eng.submit(0, greedy(SYSTEM + FIRST, 200, checkpoint_hints=[len(SYSTEM)], ignore_eos=True))
    # Wait until its prompt (and the checkpoint where SYSTEM ends) is done: it is generating.
    while not any(s.busy and s.n_tokens > len(SYSTEM + FIRST) for s in eng.slots()):
        pass
    got = eng.generate(1, greedy(SYSTEM + SECOND, 4, prefix_sources=[0]))
    assert got.timings.source_slot == 0 and got.timings.cache_n == len(SYSTEM)
    assert eng.collect(running).timings.predicted_n == 200  # the source ran on undisturbed
    scratch = make_engine("qwen35", n_slots=2)
    assert got.tokens == scratch.generate(1, greedy(SYSTEM + SECOND, 4)).tokens


def test_a_request_starts_only_from_slots_of_its_own_owner(make_engine, greedy, tmp_path: Path) -> None:
    """A slot listed as a source that another owner's request ran on since (the caller's view of
    who sits there was already stale) is never copied; nor a restored or erased slot."""
    eng = make_engine("qwen35", n_slots=3)
    eng.generate(0, greedy(SYSTEM + FIRST, 4, checkpoint_hints=[len(SYSTEM)], owner="acme"))
    other = eng.generate(1, greedy(SYSTEM + SECOND, 4, prefix_sources=[0], owner="beta"))
    assert other.timings.source_slot == -1 and other.timings.cache_n == 0  # acme's slot: not beta's
    mine = eng.generate(2, greedy(SYSTEM + SECOND, 4, prefix_sources=[0, 1], owner="acme"))
    assert mine.timings.source_slot == 0  # acme's own (slot 1 holds beta's state, never a source)
    path = tmp_path / "s.slot"
    eng.save_slot(0, str(path))
    eng.restore_slot(0, str(path))  # a restored slot has no owner until a request runs on it
    eng.erase_slot(2)
    got = eng.generate(2, greedy(SYSTEM + FIRST + [9], 2, prefix_sources=[0], owner="acme"))
    assert got.timings.source_slot == -1
    # Its own slot, last served for another owner, is cleared first: nothing of it is reused.
    theirs = eng.generate(1, greedy(SYSTEM + SECOND, 2, owner="acme"))
    assert theirs.timings.cache_n == 0
    again = eng.generate(1, greedy(SYSTEM + SECOND, 2, owner="acme"))
    assert again.timings.cache_n > 0  # (its own state now)


@pytest.mark.parametrize("kv_unified", [False, True])
def test_a_copy_of_a_prompt_longer_than_the_window_cache_goes_on(make_engine, greedy, kv_unified) -> None:
    """gemma2 (a 32-token window): a prompt longer than the window cache (2 slots: 32 * 2 + 256,
    rounded up to 512 cells) fills it with cells kept past the window; a copy shares them with its
    source, and llama.cpp reuses only a cell one sequence holds: the next llama_decode of the copy
    or of its source found no cell (code 1). Each goes on, as a fresh engine's slot would."""
    eng = make_engine("gemma2", n_slots=2, kv_unified=kv_unified)
    prompt = [1 + (i * 7919) % 200 for i in range(700)]
    eng.generate(0, greedy(prompt, 0))
    copy = eng.generate(1, greedy(prompt, 0, prefix_sources=[0]))
    assert copy.timings.source_slot == 0 and copy.timings.prompt_n == 0
    scratch = make_engine("gemma2", n_slots=2)
    expected = scratch.generate(0, greedy([*prompt, 5, 6], 6)).tokens
    for slot in (1, 0):
        got = eng.generate(slot, greedy([*prompt, 5, 6], 6))
        assert got.timings.prompt_n == 2 and got.tokens == expected

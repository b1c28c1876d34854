"""Resume exactness: a slot saved, loaded by a new engine (a restart) and continued gives the same
greedy tokens, and evaluates the same number of prompt tokens, as a slot that never left memory.

The four follow-ups of the issue: (a) a strict extension, (b) the next chat turn with the previous
assistant text re-rendered by the template, (c) a prompt diverging inside the saved prompt, (d) the
identical prompt (which must evaluate nothing).
"""

from __future__ import annotations

from pathlib import Path

import pytest

ARCHS = ["llama", "gemma2", "mamba2", "lfm2", "qwen35"]
N_GEN = 12

SYSTEM = "You are a careful assistant. Answer briefly, cite sources, and never invent numbers. " * 6
USER1 = "Summarise the plot of a long novel about ships, storms and a stubborn captain in detail please. " * 4
USER2 = "Now compare it with a story about a lighthouse keeper."


def _turn1(engine, render):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER1}]
    tmpl = engine.model.chat_template
    prompt = engine.tokenize(render(tmpl, msgs, True))
    prefix = engine.tokenize(render(tmpl, msgs[:1], False))
    return msgs, prompt, [len(prefix)]


def _followups(engine, render, msgs, prompt1, gen1_tokens, gen1_text):
    tmpl = engine.model.chat_template
    turn2 = msgs + [{"role": "assistant", "content": gen1_text}, {"role": "user", "content": USER2}]
    extension = prompt1 + gen1_tokens + engine.tokenize(" and then what happened next?", add_special=False)
    diverge_at = len(prompt1) * 2 // 3
    divergent = prompt1[:diverge_at] + engine.tokenize(
        " something else entirely, a new ending.", add_special=False
    )
    return {
        "a_extension": extension,
        "b_next_turn": engine.tokenize(render(tmpl, turn2, True)),
        "c_divergent": divergent,
        "d_identical": list(prompt1),
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_restored_slot_matches_live_slot(arch, make_engine, greedy, render, tmp_path: Path):
    live = make_engine(arch, n_slots=4, n_ubatch=64)
    msgs, prompt1, hints = _turn1(live, render)
    assert len(prompt1) > 300  # longer than gemma2's SWA cache keeps: trims need checkpoints there
    first = [live.generate(s, greedy(prompt1, N_GEN, checkpoint_hints=hints)) for s in range(4)]
    assert all(c.tokens == first[0].tokens for c in first), (
        "the same prompt must give the same tokens in every slot"
    )
    gen1 = first[0]
    assert gen1.timings.prompt_n == len(prompt1)

    path = tmp_path / "turn1.slot"
    info = live.save_slot(0, str(path))
    assert info.n_bytes == path.stat().st_size
    assert info.n_tokens == len(prompt1) + N_GEN - 1  # the last sampled token is never evaluated

    cases = _followups(live, render, msgs, prompt1, gen1.tokens, gen1.text)
    live_results = {}
    for slot, (name, prompt) in enumerate(cases.items()):
        live_results[name] = live.generate(slot, greedy(prompt, N_GEN))
    # Seeded sampling reads the whole distribution, not just its top: a stricter sameness check.
    sampled = greedy(cases["b_next_turn"], N_GEN, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    live.restore_slot(3, str(path))
    live_sampled = live.generate(3, sampled)

    restarted = make_engine(arch, n_slots=2, n_ubatch=64)  # a new instance, another slot count
    for name, prompt in cases.items():
        restored = restarted.restore_slot(1, str(path))
        assert restored.n_tokens == info.n_tokens
        assert restored.n_checkpoints == info.n_checkpoints
        got = restarted.generate(1, greedy(prompt, N_GEN))
        want = live_results[name]
        assert got.tokens == want.tokens, f"{arch} {name}: restored tokens differ from the live slot's"
        assert got.timings.prompt_n == want.timings.prompt_n, (
            f"{arch} {name}: {got.timings} vs live {want.timings}"
        )
        assert got.timings.cache_n == want.timings.cache_n
        assert got.timings.restored
        assert got.timings.cache_n > 0, f"{arch} {name}: nothing reused after restore"

    restarted.restore_slot(0, str(path))
    assert restarted.generate(0, sampled).tokens == live_sampled.tokens

    assert live_results["d_identical"].timings.prompt_n == 0
    assert live_results["d_identical"].timings.reuse == "logits"
    assert live_results["d_identical"].tokens == gen1.tokens
    assert live_results["a_extension"].timings.prompt_n == len(cases["a_extension"]) - info.n_tokens
    # The divergent prompt reuses a checkpoint (or a trim) inside the common prefix, never nothing.
    assert live_results["c_divergent"].timings.cache_n >= 16
    assert restarted.metrics().get("restores_reprefilled", 0) == 0


@pytest.mark.parametrize("arch", ["qwen35", "mamba2"])
def test_recurrent_reuse_needs_checkpoints(arch, make_engine, greedy, render):
    """Without checkpoints a hybrid/recurrent slot can only continue from its exact end."""
    eng = make_engine(arch, max_checkpoints=0)
    _, prompt1, _ = _turn1(eng, render)
    eng.generate(0, greedy(prompt1, 4))
    again = eng.generate(0, greedy(prompt1[:-5], 4))
    assert again.timings.cache_n == 0 and again.timings.prompt_n == len(prompt1) - 5


@pytest.mark.parametrize("arch", ARCHS)
def test_ten_turn_conversation_restarted_every_turn(arch, make_engine, greedy, render, tmp_path: Path):
    """An agent loop where the engine restarts between every turn costs exactly what a slot that
    never left memory costs, turn by turn, and answers the same."""
    live = make_engine(arch)
    tmpl = live.model.chat_template
    msgs: list[dict[str, object]] = [{"role": "system", "content": SYSTEM}]
    path = tmp_path / "session.slot"
    for turn in range(10):
        msgs.append({"role": "user", "content": f"Step {turn}: list the files and run the tests again."})
        prompt = live.tokenize(render(tmpl, msgs, True))
        hints = [len(live.tokenize(render(tmpl, msgs[:1], False)))]
        want = live.generate(0, greedy(prompt, 6, checkpoint_hints=hints))
        restarted = make_engine(arch)
        if turn:
            restarted.restore_slot(0, str(path))
        got = restarted.generate(0, greedy(prompt, 6, checkpoint_hints=hints))
        assert got.tokens == want.tokens, f"{arch} turn {turn}"
        assert (got.timings.prompt_n, got.timings.cache_n) == (want.timings.prompt_n, want.timings.cache_n)
        if turn:
            assert got.timings.cache_n > len(prompt) // 2, f"{arch} turn {turn}: {got.timings}"
        restarted.save_slot(0, str(path))
        restarted.close()
        msgs.append({"role": "assistant", "content": want.text})

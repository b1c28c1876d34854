"""llama-server's engine options in the core: --kv-unified, -ctk/-ctv, --no-mmap, --mlock,
--no-warmup, --context-shift, and per-token log probabilities (n_probs).

Every test runs the real core on the tiny random models; slot files are read back with the pure
Python reader (storage/slotfile/reader.py) to see what the core recorded.
"""

from __future__ import annotations

import asyncio
import math
import resource
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import native
from storage.slotfile.reader import read_slot_file

TEXT = "The quick brown fox jumps over the lazy dog while the clocks strike thirteen. "


def _long_prompt(eng: native.Engine, n: int) -> list[int]:
    toks = eng.tokenize(TEXT * (n // 8 + 4))
    assert len(toks) >= n
    return toks[:n]


def _stream(eng: native.Engine, slot: int, params: native.RequestParams) -> list[native.Event]:
    """Every event of one request as `Engine.stream` yields them (the last is done or error)."""

    async def run() -> list[native.Event]:
        return [ev async for ev in eng.stream(slot, params)]

    return asyncio.run(run())


def _wait_until(cond: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


# -- --kv-unified ---------------------------------------------------------------------------------


def test_kv_unified_lets_one_slot_use_the_whole_pool(make_engine, greedy):
    split = make_engine("llama", n_slots=4, n_ctx=1024)
    pooled = make_engine("llama", n_slots=4, n_ctx=1024, kv_unified=True)
    assert (split.n_ctx_slot, pooled.n_ctx_slot) == (256, 1024)
    assert pooled.config.kv_unified and not split.config.kv_unified

    prompt = _long_prompt(pooled, 700)  # far past n_ctx / n_slots
    with pytest.raises(native.InvalidRequestError, match="context holds 256"):
        split.submit(2, greedy(prompt, 4))
    got = pooled.generate(2, greedy(prompt, 8))
    assert got.stop_reason == "length" and len(got.tokens) == 8
    assert got.timings.prompt_n == 700

    # The same tokens as an engine whose only slot has the same 1024 cells.
    solo = make_engine("llama", n_slots=1, n_ctx=1024)
    assert solo.generate(0, greedy(prompt, 8)).tokens == got.tokens


def test_kv_unified_generation_stops_at_the_whole_pool(make_engine, greedy):
    eng = make_engine("llama", n_slots=2, n_ctx=256, kv_unified=True)
    prompt = _long_prompt(eng, 200)
    got = eng.generate(1, greedy(prompt, -1, ignore_eos=True))
    assert got.stop_reason == "context"
    assert len(prompt) + len(got.tokens) == 256  # the last sampled token is never evaluated
    assert eng.slots()[1].n_tokens == 255


def test_kv_unified_idle_sessions_give_their_cells_back(make_engine, greedy):
    eng = make_engine("llama", n_slots=2, n_ctx=1024, kv_unified=True)
    a = _long_prompt(eng, 700)
    b = eng.tokenize("Call me Ishmael. Some years ago, never mind how long precisely. " * 40)[:600]
    eng.generate(0, greedy(a, 4))
    assert eng.slots()[0].n_tokens == 703
    got = eng.generate(1, greedy(b, 8))  # 703 + 600 > 1024: slot 0's idle session makes room
    m = eng.metrics()
    assert m["kv_pool_evictions"] == 1 and m["kv_pool_evicted_tokens"] == 703
    assert [s.n_tokens for s in eng.slots()] == [0, 607]
    solo = make_engine("llama", n_slots=1, n_ctx=1024)
    assert got.tokens == solo.generate(0, greedy(b, 8)).tokens


def test_kv_unified_pool_full_fails_the_new_prompt_cleanly(make_engine, greedy):
    """Two live requests that together need more than the pool: the one still evaluating its prompt
    fails with a clear error, the generating one goes on untouched, and the engine keeps serving."""
    eng = make_engine("llama", n_slots=2, n_ctx=1024, n_batch=64, kv_unified=True)
    a = _long_prompt(eng, 800)
    b = eng.tokenize("Call me Ishmael. Some years ago, never mind how long precisely. " * 40)[:400]
    ra = eng.submit(0, greedy(a, 60, ignore_eos=True))
    _wait_until(lambda: eng.slots()[0].n_tokens >= 800, "slot 0 to finish its prompt")
    rb = eng.submit(1, greedy(b, 4))
    with pytest.raises(native.NativeError, match="the KV cache is full"):
        eng.collect(rb)
    assert eng.metrics()["kv_pool_requests_failed"] == 1
    done_a = eng.collect(ra)
    assert done_a.stop_reason == "length" and len(done_a.tokens) == 60
    solo = make_engine("llama", n_slots=1, n_ctx=1024, n_batch=64)
    assert done_a.tokens == solo.generate(0, greedy(a, 60, ignore_eos=True)).tokens
    # Slot 0 is idle now: the same request succeeds by taking its cells.
    assert eng.generate(1, greedy(b, 4)).stop_reason == "length"
    assert eng.slots()[1].n_tokens == 403


@pytest.mark.parametrize("shift", [False, True])
def test_kv_unified_pool_full_while_generating(shift, make_engine, greedy):
    """Both requests generate when the pool runs dry: the longer one stops ("context") and its cells
    go to the other; with --context-shift it shifts instead and both finish."""
    eng = make_engine("llama", n_slots=2, n_ctx=1024, kv_unified=True, context_shift=shift)
    a = _long_prompt(eng, 500)
    b = eng.tokenize("Call me Ishmael. Some years ago, never mind how long precisely. " * 40)[:400]
    ra = eng.submit(0, greedy(a, 500, ignore_eos=True))
    rb = eng.submit(1, greedy(b, 500, ignore_eos=True))
    done = [eng.collect(ra), eng.collect(rb)]
    m = eng.metrics()
    if shift:
        assert [d.stop_reason for d in done] == ["length", "length"]
        assert done[0].timings.context_shifts >= 1 and m["context_shifts"] >= 1
        assert "kv_pool_requests_stopped" not in m
    else:
        assert [d.stop_reason for d in done] == ["context", "length"]
        assert len(done[0].tokens) < 500 and len(done[1].tokens) == 500
        assert m["kv_pool_requests_stopped"] == 1 and m["kv_pool_evictions"] >= 1
    assert m["kv_pool_full"] >= 1 and "kv_pool_requests_failed" not in m


def test_slot_files_move_between_split_and_pooled_engines(make_engine, greedy, tmp_path: Path):
    """A file restores into an engine with another slot count and either setting when the slot
    there has room for it; the recorded shape says what it came from."""
    src = make_engine("llama", n_slots=1, n_ctx=1024)
    prompt = _long_prompt(src, 600)
    src.generate(0, greedy(prompt, 4))
    want = src.generate(0, greedy(prompt + [7, 8, 9], 10))
    src.erase_slot(0)
    src.generate(0, greedy(prompt, 4))
    path = tmp_path / "s.slot"
    src.save_slot(0, str(path))
    ctx = read_slot_file(path).meta["context"]
    assert (ctx["n_ctx"], ctx["n_slots"], ctx["n_ctx_slot"], ctx["kv_unified"]) == (1024, 1, 1024, True)

    pooled = make_engine("llama", n_slots=4, n_ctx=1024, kv_unified=True)
    assert pooled.restore_slot(3, str(path)).n_tokens == 603
    got = pooled.generate(3, greedy(prompt + [7, 8, 9], 10))
    assert got.tokens == want.tokens and got.timings.restored
    assert (got.timings.cache_n, got.timings.prompt_n) == (want.timings.cache_n, want.timings.prompt_n)

    split = make_engine("llama", n_slots=4, n_ctx=1024)  # 256 tokens a slot
    with pytest.raises(native.SlotFileError) as exc:
        split.restore_slot(1, str(path))
    assert exc.value.kind == "too_large" and "room for 255" in str(exc.value)

    # Back again: a pooled engine's file into a split engine with slots large enough.
    pooled.save_slot(3, str(tmp_path / "p.slot"))
    assert read_slot_file(tmp_path / "p.slot").meta["context"]["n_ctx_slot"] == 1024
    wide = make_engine("llama", n_slots=2, n_ctx=2048)
    held = pooled.slot_tokens(3)
    assert len(held) > 256 and wide.restore_slot(1, str(tmp_path / "p.slot")).n_tokens == len(held)
    assert wide.slot_tokens(1) == held
    assert wide.generate(1, greedy(held + [3], 6)).tokens == pooled.generate(3, greedy(held + [3], 6)).tokens


def test_kv_unified_restore_needs_free_cells(make_engine, greedy, tmp_path: Path):
    eng = make_engine("llama", n_slots=2, n_ctx=1024, kv_unified=True)
    prompt = _long_prompt(eng, 600)
    eng.generate(0, greedy(prompt, 2))
    path = tmp_path / "s.slot"
    eng.save_slot(0, str(path))
    # Slot 0's idle session (601 cells) gives way to a 601-token restore into slot 1.
    assert eng.restore_slot(1, str(path)).n_tokens == 601
    assert [s.n_tokens for s in eng.slots()] == [0, 601] and eng.metrics()["kv_pool_evictions"] == 1

    # A live request's cells are not given away: the restore is refused and its slot left empty.
    busy = eng.submit(1, greedy(prompt + [5], 200, ignore_eos=True))
    _wait_until(lambda: eng.slots()[1].n_tokens >= 610, "slot 1 to be generating")
    with pytest.raises(native.SlotFileError) as exc:
        eng.restore_slot(0, str(path))
    assert exc.value.kind == "too_large" and "--kv-unified" in str(exc.value)
    assert eng.slot_tokens(0) == []
    assert eng.collect(busy).stop_reason == "length"


# -- -ctk / -ctv ----------------------------------------------------------------------------------


def test_kv_cache_types_are_checked_before_the_model_loads(tiny_model):
    path = tiny_model("llama")
    with pytest.raises(native.InvalidRequestError, match=r"--cache-type-k: unknown KV cache type 'q3_k'"):
        native.Engine(native.EngineConfig(path, n_ctx=256, cache_type_k="q3_k"))
    with pytest.raises(native.InvalidRequestError, match=r"--cache-type-v q8_0 needs flash attention"):
        native.Engine(native.EngineConfig(path, n_ctx=256, cache_type_v="q8_0"))
    assert native.KV_CACHE_TYPES == ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


@pytest.mark.parametrize("types", [("q8_0", "f16", False), ("bf16", "bf16", False), ("q4_0", "q5_1", True)])
def test_every_kv_cache_type_serves(types, make_engine, greedy):
    k, v, fa = types
    eng = make_engine("llama", cache_type_k=k, cache_type_v=v, flash_attn=fa)
    assert (eng.config.cache_type_k, eng.config.cache_type_v) == (k, v)
    got = eng.generate(0, greedy(_long_prompt(eng, 100), 6))
    assert len(got.tokens) == 6


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_q8_0_halves_the_kv_and_the_slot_file(arch, make_engine, greedy, tmp_path: Path):
    f16 = make_engine(arch, flash_attn=True, max_checkpoints=0)
    q8 = make_engine(arch, flash_attn=True, max_checkpoints=0, cache_type_k="q8_0", cache_type_v="q8_0")
    prompt = _long_prompt(f16, 800)
    sizes = {}
    for name, eng in (("f16", f16), ("q8_0", q8)):
        eng.generate(0, greedy(prompt, 2))
        path = tmp_path / f"{name}.slot"
        info = eng.save_slot(0, str(path))
        sf = read_slot_file(path)
        assert (sf.meta["context"]["type_k"], sf.meta["context"]["type_v"]) == (name, name)
        sizes[name] = (sf.state_len, info.n_bytes)
    (state16, file16), (state8, file8) = sizes["f16"], sizes["q8_0"]
    if arch == "llama":  # all attention: q8_0 is 34 bytes per 32 values against 64
        assert 0.50 < state8 / state16 < 0.56, sizes
        assert file8 / file16 < 0.6, sizes
    else:  # qwen35: one attention layer in four; its recurrent state stays f32
        assert state8 < state16, sizes


def test_q8_0_slot_files_roundtrip_exactly_and_refuse_other_types(make_engine, greedy, tmp_path: Path):
    opts = {"flash_attn": True, "cache_type_k": "q8_0", "cache_type_v": "q8_0"}
    live = make_engine("llama", **opts)
    prompt = _long_prompt(live, 300)
    live.generate(0, greedy(prompt, 4))
    path = tmp_path / "q8.slot"
    live.save_slot(0, str(path))
    want = live.generate(0, greedy(prompt + [11, 12], 12))

    again = make_engine("llama", **opts)
    again.restore_slot(0, str(path))
    got = again.generate(0, greedy(prompt + [11, 12], 12))
    assert got.tokens == want.tokens
    assert (got.timings.prompt_n, got.timings.cache_n) == (want.timings.prompt_n, want.timings.cache_n)

    for other in ({"flash_attn": True}, {"flash_attn": True, "cache_type_k": "q8_0"}):
        eng = make_engine("llama", **other)
        eng.generate(0, greedy(prompt[:50], 2))  # something to lose
        with pytest.raises(native.SlotFileError) as exc:
            eng.restore_slot(0, str(path))
        assert exc.value.kind == "shape_mismatch"
        assert "k=q8_0 v=q8_0" in str(exc.value) and "-ctk/-ctv" in str(exc.value)
        assert eng.slot_tokens(0) == []  # left empty, never the old session
        fresh = eng.generate(0, greedy(prompt + [11, 12], 4))  # the clean re-prefill
        assert fresh.timings.cache_n == 0 and fresh.timings.prompt_n == len(prompt) + 2
        assert eng.metrics()["slot_restore_errors"] == 1


# -- --no-mmap, --mlock, --no-warmup --------------------------------------------------------------


def _mapped(path: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(path in line for line in f)


def _locked_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmLck:"):
                return int(line.split()[1])
    return 0


def test_load_options(tiny_model, greedy, tmp_path: Path):
    path = str(tmp_path / "load.gguf")  # a copy no other test's engine maps
    shutil.copyfile(tiny_model("llama"), path)
    want: list[int] | None = None

    def serve(**kw: object) -> native.Engine:
        nonlocal want
        eng = native.Engine(native.EngineConfig(path, n_ctx=512, n_threads=2, **kw))  # type: ignore[arg-type]
        got = eng.generate(0, greedy(eng.tokenize(TEXT * 4), 8))
        assert got.timings is not None and got.timings.cache_n == 0  # the warmup left nothing behind
        want = want or got.tokens
        assert got.tokens == want, kw
        return eng

    default = serve()
    assert _mapped(path) and default.metrics()["warmups"] == 1
    default.close()
    del default
    assert not _mapped(path)

    no_mmap = serve(use_mmap=False)
    assert not _mapped(path) and not no_mmap.config.use_mmap
    no_mmap.close()

    cold = serve(warmup=False)
    assert "warmups" not in cold.metrics()
    cold.close()

    before = _locked_kb()
    locked = serve(use_mlock=True)
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    size_kb = Path(path).stat().st_size // 1024
    if soft == resource.RLIM_INFINITY or soft // 1024 >= before + 2 * size_kb:  # else llama.cpp only warns
        assert _locked_kb() >= before + size_kb // 2
    locked.close()


# -- --context-shift ------------------------------------------------------------------------------


def _shifted(tokens: list[int], n_ctx_slot: int, keep: int, n_sampled: list[int]) -> list[int]:
    """What the slot holds after a shifting generation, simulated the way llama-server shifts."""
    seq = list(tokens)
    for i, t in enumerate(n_sampled):
        if i == len(n_sampled) - 1:
            break  # the last sampled token is never evaluated
        if len(seq) + 1 >= n_ctx_slot:
            discard = (len(seq) - keep) // 2
            seq = seq[:keep] + seq[keep + discard :]
        seq.append(t)
    return seq


@pytest.mark.parametrize(("arch", "extra"), [("llama", {}), ("gemma2", {"swa_full": True})])
@pytest.mark.parametrize("n_keep", [0, 10, -1])
def test_context_shift_goes_past_the_context(arch, extra, n_keep, make_engine, greedy):
    eng = make_engine(arch, n_ctx=256, context_shift=True, **extra)  # llama.cpp's smallest context
    assert eng.n_ctx_slot == 256
    prompt = _long_prompt(eng, 80)
    got = eng.generate(0, greedy(prompt, 500, ignore_eos=True, n_keep=n_keep))
    assert got.stop_reason == "length" and len(got.tokens) == 500
    assert got.timings.context_shifts >= 3
    assert eng.metrics()["context_shifts"] == got.timings.context_shifts

    keep = len(prompt) if n_keep < 0 else n_keep + (1 if eng.model.add_bos else 0)
    held = eng.slot_tokens(0)
    assert held == _shifted(prompt, 256, keep, got.tokens)
    assert held[:keep] == prompt[:keep] and len(held) < 256

    # The token list is the sequence: a request that extends it reuses all of it.
    more = eng.generate(0, greedy(held + [5], 4))
    assert more.timings.cache_n == len(held) and more.timings.prompt_n == 1


def test_without_context_shift_generation_stops_at_the_context(make_engine, greedy):
    eng = make_engine("llama", n_ctx=256)
    prompt = _long_prompt(eng, 80)
    got = eng.generate(0, greedy(prompt, 500, ignore_eos=True))
    assert got.stop_reason == "context" and len(prompt) + len(got.tokens) == 256
    assert got.timings.context_shifts == 0


def test_context_shift_shifted_cache_is_what_llama_server_keeps(make_engine, greedy):
    """After a shift the kept prefix is untouched: a request on the kept tokens alone is served from
    the slot without evaluation differences (same greedy continuation as a fresh engine)."""
    eng = make_engine("llama", n_ctx=256, context_shift=True)
    prompt = _long_prompt(eng, 60)
    eng.generate(0, greedy(prompt, 300, ignore_eos=True, n_keep=50))
    keep = 50 + (1 if eng.model.add_bos else 0)
    held = eng.slot_tokens(0)
    assert held[:keep] == prompt[:keep] and held[keep] != 9
    fresh = make_engine("llama", n_ctx=256)
    fresh.generate(0, greedy(prompt[:keep], 1))
    want = fresh.generate(0, greedy(prompt[:keep] + [9, 9], 8))
    got = eng.generate(0, greedy(prompt[:keep] + [9, 9], 8))
    assert got.timings.cache_n == keep and got.tokens == want.tokens


@pytest.mark.parametrize(
    ("arch", "extra", "why"),
    [
        ("qwen35", {}, "hybrid"),
        ("lfm2", {}, "hybrid"),
        ("mamba2", {}, "recurrent"),
        ("gemma2", {}, "--swa-full"),
    ],
)
def test_context_shift_is_refused_where_it_cannot_work(arch, extra, why, tiny_model):
    # n_ctx past the sliding window (gemma2's SWA cache is full-size, so shiftable, below it).
    with pytest.raises(native.InvalidRequestError, match="--context-shift") as exc:
        native.Engine(native.EngineConfig(tiny_model(arch), n_ctx=2048, context_shift=True, **extra))
    assert why in str(exc.value)


def test_context_shift_request_bounds(make_engine, greedy):
    eng = make_engine("llama", n_ctx=256, context_shift=True)
    prompt = _long_prompt(eng, 20)
    with pytest.raises(native.InvalidRequestError, match="n_keep"):
        eng.submit(0, greedy(prompt, 4, n_keep=-2))
    with pytest.raises(native.InvalidRequestError, match="n_discard"):
        eng.submit(0, greedy(prompt, 4, n_discard=-1))
    got = eng.generate(0, greedy(prompt, 400, ignore_eos=True, n_discard=8))
    assert got.timings.context_shifts >= 20  # 8 at a time


# -- n_probs --------------------------------------------------------------------------------------


def _check_probs(ev: native.Event, n_probs: int) -> None:
    top = ev.top_logprobs
    assert len(top) == n_probs
    lps = [lp for _, lp in top]
    assert lps == sorted(lps, reverse=True)
    assert all(lp <= 0.0 for lp in lps)
    assert sum(math.exp(lp) for lp in lps) <= 1.0 + 1e-5
    assert ev.logprob <= top[0][1] + 1e-6
    for tok, lp in top:
        if tok == ev.token:
            assert lp == pytest.approx(ev.logprob, abs=1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_greedy_logprobs(arch, make_engine, greedy):
    eng = make_engine(arch, n_slots=2)
    prompt = _long_prompt(eng, 80)
    evs = _stream(eng, 0, greedy(prompt, 10, n_probs=5))
    assert evs[-1].kind == "done"
    tokens = evs[:-1]
    assert len(tokens) == 10 and all(ev.kind == "token" for ev in tokens)
    for ev in tokens:
        _check_probs(ev, 5)
        assert ev.top_logprobs[0][0] == ev.token  # greedy picks the most probable
        assert ev.top_logprobs[0][1] == pytest.approx(ev.logprob, abs=1e-6)

    # As many as asked, up to the bound; never more than the vocabulary holds.
    wide = eng.generate(1, greedy(eng.tokenize("Hello"), 2, n_probs=native.MAX_N_PROBS))
    assert [len(t) for t in wide.top_logprobs] == [min(native.MAX_N_PROBS, eng.model.n_vocab)] * 2

    # An identical prompt samples from stored logits: the same probabilities as when evaluated.
    again = eng.generate(0, greedy(prompt, 1, n_probs=5))
    assert again.timings.prompt_n == 0 and again.tokens == [tokens[0].token]
    assert [t for t, _ in again.top_logprobs[0]] == [t for t, _ in tokens[0].top_logprobs]
    assert [lp for _, lp in again.top_logprobs[0]] == pytest.approx([lp for _, lp in tokens[0].top_logprobs])


def test_sampled_logprobs_and_the_completion(make_engine, greedy):
    eng = make_engine("llama")
    prompt = _long_prompt(eng, 60)
    params = greedy(prompt, 24, n_probs=3, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    got = eng.generate(0, params)
    assert len(got.logprobs) == len(got.top_logprobs) == len(got.tokens) == 24
    outside = 0
    for tok, lp, top in zip(got.tokens, got.logprobs, got.top_logprobs, strict=True):
        assert len(top) == 3 and lp <= top[0][1] + 1e-6
        ids = [t for t, _ in top]
        if tok in ids:
            assert top[ids.index(tok)][1] == pytest.approx(lp, abs=1e-6)
        else:
            outside += 1
            assert lp <= top[-1][1] + 1e-6
    assert outside > 0  # a hot, flat distribution: some samples fall outside the top 3


def test_logprobs_off_and_bounds(make_engine, greedy):
    eng = make_engine("llama")
    prompt = _long_prompt(eng, 30)
    plain = eng.generate(0, greedy(prompt, 4))
    assert plain.logprobs == [] and plain.top_logprobs == []
    assert all(ev.top_logprobs == [] and ev.logprob == 0.0 for ev in _stream(eng, 0, greedy(prompt, 2)))
    for bad in (-1, native.MAX_N_PROBS + 1):
        with pytest.raises(native.InvalidRequestError, match="n_probs"):
            eng.submit(0, greedy(prompt, 2, n_probs=bad))

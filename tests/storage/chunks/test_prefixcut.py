"""A stored hybrid session restored only up to the checkpoint an early-diverging prompt continues
from: the real engine (tiny qwen35, two slots), a real local store, the in-process ledger. The cut
file must leave the engine exactly where the whole file does for that prompt: same answer, same
tokens evaluated and reused, from fewer bytes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path

import pytest

import native
from storage.blobs.localstore import LocalStore
from storage.chunks.chunkstore import ChunkedStore
from storage.chunks.ledger import ChunkLedger
from storage.chunks.prefixcut import cut_point
from storage.errors import ChecksumError
from storage.ids import SlotRef
from storage.index.keyspace import in_process_redis
from storage.slotfile.reader import read_slot_file

HINTS = (600, 1200)  # message boundaries; the engine adds interval checkpoints at 1024 and the prompt end


@pytest.fixture(scope="module")
def engine(tiny_model: Callable[..., str]) -> Iterator[native.Engine]:
    config = native.EngineConfig(tiny_model("qwen35"), n_ctx=4096, n_slots=2, checkpoint_interval=1024)
    with closing(native.Engine(config)) as eng:
        yield eng


def _run(eng: native.Engine, slot: int, tokens: list[int], hints: tuple[int, ...] = ()) -> native.Completion:
    p = native.RequestParams(tokens)
    p.n_predict, p.temperature, p.checkpoint_hints = 8, 0.0, list(hints)
    return eng.generate(slot, p)


@pytest.fixture(scope="module")
def saved(engine: native.Engine, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[int], Path]:
    """A 1,500-token session saved from slot 0 after two turns (its checkpoints: 600, a message
    boundary; 1024, an interval; 1200, where the first turn's prompt ended; 1500, the second's)."""
    tokens = engine.tokenize("The agent reads the file, runs the tests and writes a fix. " * 120)[:1500]
    assert len(tokens) == 1500
    engine.erase_slot(0)
    _run(engine, 0, tokens[:1200], HINTS[:1])
    _run(engine, 0, tokens, HINTS)
    path = tmp_path_factory.mktemp("prefix") / "session.slot"
    engine.save_slot(0, str(path))
    return tokens, path


@pytest.fixture(params=["raw", "compressed"])
async def store(
    tmp_path: Path, saved: tuple[list[int], Path], request: pytest.FixtureRequest
) -> ChunkedStore:
    """The saved session in a store, its states stored as they are and compressed."""
    st = ChunkedStore(
        LocalStore(tmp_path / "blobs", prefix="sk"),
        ChunkLedger(in_process_redis()),
        compress=request.param == "compressed",
    )
    sf = read_slot_file(saved[1])
    await st.put_file(SlotRef("acme", "s1", 1), saved[1], model="m", n_tokens=sf.n_tokens)
    return st


def _served(eng: native.Engine, path: Path, prompt: list[int]) -> tuple[int, str, int, int]:
    """Restore ``path`` into slot 1 and run ``prompt``: restored tokens, answer, prompt_n, cache_n."""
    eng.erase_slot(1)
    info = eng.restore_slot(1, str(path))
    done = _run(eng, 1, prompt)
    return info.n_tokens, done.text, done.timings.prompt_n, done.timings.cache_n


@pytest.mark.parametrize(
    ("diverge", "at"),
    [(1000, 600), (1100, 1024), (1300, 1200), (700, 600)],
)
async def test_an_early_divergence_restores_only_up_to_its_checkpoint_and_answers_the_same(
    engine: native.Engine,
    store: ChunkedStore,
    saved: tuple[list[int], Path],
    tmp_path: Path,
    diverge: int,
    at: int,
) -> None:
    tokens, _ = saved
    ref = SlotRef("acme", "s1", 1)
    prompt = tokens[:diverge] + engine.tokenize(" Instead, revert the change and explain why it failed.")
    whole = await store.get_to_file(ref, tmp_path / "whole.slot")
    cut = await store.get_prefix_to_file(ref, tmp_path / "cut.slot", prompt)
    assert cut is not None and cut.n_tokens == at and cut.size < whole.size
    assert read_slot_file(tmp_path / "cut.slot").checksum_ok
    n_whole, text_whole, prompt_n_whole, cache_whole = _served(engine, tmp_path / "whole.slot", prompt)
    n_cut, text_cut, prompt_n_cut, cache_cut = _served(engine, tmp_path / "cut.slot", prompt)
    assert (n_whole, n_cut) == (whole.n_tokens, at)
    assert (text_cut, prompt_n_cut, cache_cut) == (text_whole, prompt_n_whole, cache_whole)
    assert cache_cut == at and prompt_n_cut == len(prompt) - at


async def test_a_prompt_ending_on_a_checkpoint_is_answered_from_its_logits(
    engine: native.Engine, store: ChunkedStore, saved: tuple[list[int], Path], tmp_path: Path
) -> None:
    tokens, _ = saved
    ref = SlotRef("acme", "s1", 1)
    prompt = tokens[:1200]  # a retry of the turn that ended there
    await store.get_to_file(ref, tmp_path / "whole.slot")
    assert (await store.get_prefix_to_file(ref, tmp_path / "cut.slot", prompt)) is not None
    whole, cut = (_served(engine, tmp_path / f"{n}.slot", prompt) for n in ("whole", "cut"))
    assert cut[1:] == whole[1:] and cut[2] == 0


async def test_no_cut_when_the_prompt_goes_on_from_the_end_or_matches_no_checkpoint(
    engine: native.Engine, store: ChunkedStore, saved: tuple[list[int], Path], tmp_path: Path
) -> None:
    tokens, _ = saved
    ref = SlotRef("acme", "s1", 1)
    saved_tokens = engine.slot_tokens(0)  # the prompt and what was generated after it
    onwards = saved_tokens + engine.tokenize(" Next step.")
    assert await store.get_prefix_to_file(ref, tmp_path / "a.slot", onwards) is None
    other = engine.tokenize("A different conversation altogether. " * 40)
    assert await store.get_prefix_to_file(ref, tmp_path / "b.slot", other) is None
    assert await store.get_prefix_to_file(ref, tmp_path / "c.slot", []) is None
    assert await store.get_prefix_to_file(SlotRef("acme", "nope", 1), tmp_path / "d.slot", tokens) is None
    assert not any((tmp_path / n).exists() for n in ("a.slot", "b.slot", "c.slot", "d.slot"))


async def test_a_damaged_piece_below_the_cut_is_named(
    store: ChunkedStore, saved: tuple[list[int], Path], tmp_path: Path
) -> None:
    tokens, _ = saved
    victims = sorted((tmp_path / "blobs").rglob("*.kv"))
    for victim in victims:  # every KV chunk (the cut reads those below 600)
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="do not match the CRC in its name") as err:
        await store.get_prefix_to_file(SlotRef("acme", "s1", 1), tmp_path / "cut.slot", tokens[:1000])
    assert any(v.name in str(err.value) for v in victims)
    assert not (tmp_path / "cut.slot").exists()


def test_the_cut_point_follows_the_checkpoint_names() -> None:
    plan = {"layout": None, "checkpoints": [[4, "x-00000000", 1, 0]], "n_tokens": 10}
    assert cut_point(plan, "ns", [1, 2, 3, 4, 5]) is None  # no chunkable KV: never cut


async def test_a_session_ending_on_a_chunk_boundary_restores_byte_for_byte(
    engine: native.Engine, tmp_path: Path
) -> None:
    """No tokens after the last whole chunk (an empty tail range): assembled both ways, the file is
    the engine's own."""
    tokens = engine.tokenize("Exactly four chunks of tokens, no more and no less. " * 80)[:1017]
    engine.erase_slot(0)
    _run(engine, 0, tokens)  # 8 generated, 7 of them evaluated: 1,024 in the slot
    src = tmp_path / "boundary.slot"
    engine.save_slot(0, str(src))
    assert read_slot_file(src).n_tokens == 1024
    inner = LocalStore(tmp_path / "blobs", prefix="sk")
    async with ChunkedStore(inner, ChunkLedger(in_process_redis())) as st:
        ref = SlotRef("acme", "b", 1)
        await st.put_file(ref, src, model="m", n_tokens=1024)
        for verify in (True, False):
            await st.get_to_file(ref, tmp_path / "back.slot", verify=verify)
            assert (tmp_path / "back.slot").read_bytes() == src.read_bytes()


async def test_only_hybrid_models_are_cut(tiny_model: Callable[..., str], tmp_path: Path) -> None:
    """A sliding-window model (gemma2) keeps its checkpoints' window state too, but its engine may
    continue from further on than a checkpoint (it trims while the window is still cached): a cut
    could keep less than a whole restore, so none is made."""
    eng = native.Engine(
        native.EngineConfig(tiny_model("gemma2"), n_ctx=4096, n_slots=1, checkpoint_interval=256)
    )
    try:
        tokens = eng.tokenize("The agent reads the file, runs the tests and writes a fix. " * 60)[:900]
        _run(eng, 0, tokens, (600,))
        eng.save_slot(0, str(tmp_path / "swa.slot"))
    finally:
        eng.close()
    sf = read_slot_file(tmp_path / "swa.slot")
    assert any(c.target_bytes_len for c in sf.checkpoints)  # window state a cut could otherwise use
    inner = LocalStore(tmp_path / "blobs", prefix="sk")
    async with ChunkedStore(inner, ChunkLedger(in_process_redis())) as st:
        ref = SlotRef("acme", "w", 1)
        await st.put_file(ref, tmp_path / "swa.slot", model="m", n_tokens=sf.n_tokens)
        assert await st.get_prefix_to_file(ref, tmp_path / "cut.slot", tokens[:700] + [1, 2, 3]) is None
    assert not (tmp_path / "cut.slot").exists()

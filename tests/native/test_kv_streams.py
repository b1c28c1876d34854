"""Per-slot KV streams (llama.cpp's non-unified KV) for plain hybrid models: which engines get
them, and that slot files stay the one-stream form whatever the writer's and the reader's slot
counts — a session saved from any stream restores into any other engine and continues as the
live slot does, and the chunked store can still take its attention cache apart."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest

import native
from storage.chunks.chunking import parse_kv
from storage.slotfile.reader import read_slot_file

TRAILER = 64
PROMPT = [1 + (i * 7919) % 200 for i in range(300)]


def test_plain_hybrids_with_several_slots_get_a_stream_per_slot(make_engine) -> None:
    assert make_engine("qwen35", n_slots=4).kv_streams
    assert make_engine("lfm2", n_slots=2).kv_streams
    assert not make_engine("qwen35", n_slots=1).kv_streams  # one slot: one stream anyway
    assert not make_engine("qwen35", n_slots=4, kv_unified=True).kv_streams  # the shared pool
    odd = make_engine("qwen35", n_slots=3, n_ctx=1000)  # streams of 512 cells (rounded up to 256)
    assert odd.kv_streams and odd.n_ctx_slot == 1024 // 3  # a slot's share as with one stream
    assert not make_engine("llama", n_slots=4).kv_streams  # attention-only: one stream
    assert not make_engine("gemma2", n_slots=4).kv_streams  # sliding window: one stream
    assert not make_engine("mamba2", n_slots=4).kv_streams  # no attention cache at all
    eng = make_engine("qwen35", n_slots=4)
    assert eng.n_ctx_slot == 1024


def _state_stream_count(path: Path) -> int:
    sf = read_slot_file(path)
    assert sf.checksum_ok
    data = path.read_bytes()
    return struct.unpack_from("<I", data, sf.state_offset)[0]


@pytest.mark.parametrize("arch", ["qwen35", "lfm2"])
def test_a_session_moves_between_streams_and_slot_counts(arch, make_engine, greedy, tmp_path: Path) -> None:
    four = make_engine(arch, n_slots=4)
    assert four.kv_streams
    first = four.generate(2, greedy(PROMPT, 8))  # a middle stream: empty ones on both sides
    saved = tmp_path / "s2.slot"
    info = four.save_slot(2, str(saved))
    assert _state_stream_count(saved) == 1
    nxt = [*PROMPT, *first.tokens, 5, 6, 7]
    live = four.generate(2, greedy(nxt, 8))

    one = make_engine(arch, n_slots=1)  # unified: the file as written, no streams to add
    two = make_engine(arch, n_slots=2)
    for eng, slot in ((one, 0), (two, 1), (two, 0), (four, 3), (four, 0)):
        got = eng.restore_slot(slot, str(saved))
        assert (got.n_tokens, got.n_checkpoints) == (info.n_tokens, info.n_checkpoints)
        out = eng.generate(slot, greedy(nxt, 8))
        assert out.tokens == live.tokens, f"{arch}: restored into slot {slot} of {eng.config.n_slots}"
        assert out.timings.prompt_n == live.timings.prompt_n == 3 + 1  # the last sampled token, then 5, 6, 7
        assert out.timings.restored

    # And back: a file a one-stream engine wrote restores into a stream of a four-slot engine.
    one_file = tmp_path / "one.slot"
    one.save_slot(0, str(one_file))
    assert _state_stream_count(one_file) == 1
    four.restore_slot(1, str(one_file))
    assert four.generate(1, greedy([*nxt, *live.tokens, 9], 4)).timings.prompt_n == 2


def test_a_streamed_save_is_chunkable_by_the_store(make_engine, greedy, tmp_path: Path) -> None:
    four = make_engine("qwen35", n_slots=4)
    four.generate(3, greedy(PROMPT, 4))  # the last stream: empty ones before it only
    path = tmp_path / "s3.slot"
    four.save_slot(3, str(path))
    sf = read_slot_file(path)
    state = memoryview(path.read_bytes())[sf.state_offset : sf.base_len]
    assert parse_kv(state, sf.n_tokens, sf.meta) is not None


def test_a_short_session_restores_where_the_file_leaves_no_room_for_the_streams(
    make_engine, greedy, tmp_path: Path
) -> None:
    # A 1-token file has 8 bytes before its state's prefix: room for 2 empty streams' counts in
    # place, not for the 7 an eight-slot engine needs (the state is copied then).
    one = make_engine("qwen35", n_slots=1)
    t = one.generate(0, greedy([11], 1)).tokens[0]
    path = tmp_path / "short.slot"
    assert one.save_slot(0, str(path)).n_tokens == 1
    want = one.generate(0, greedy([11, t, 12], 4))
    assert want.timings.prompt_n == 2
    for n_slots in (3, 8):  # in place; copied
        eng = make_engine("qwen35", n_slots=n_slots, n_ctx=n_slots * 256)
        assert eng.kv_streams
        for slot in (n_slots - 1, 0):
            eng.restore_slot(slot, str(path))
            got = eng.generate(slot, greedy([11, t, 12], 4))
            assert got.tokens == want.tokens, f"slot {slot} of {n_slots}"
            assert got.timings.prompt_n == 2


def test_a_file_not_in_the_one_stream_form_is_refused_and_the_slot_left_empty(
    make_engine, greedy, tmp_path: Path
) -> None:
    one = make_engine("qwen35", n_slots=1)
    one.generate(0, greedy(PROMPT, 4))
    path = tmp_path / "x.slot"
    one.save_slot(0, str(path))
    sf = read_slot_file(path)
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, sf.state_offset, 2)  # "two streams", CRCs made right again
    body, trailer = bytes(data[:-TRAILER]), bytearray(data[-TRAILER:])
    struct.pack_into("<I", trailer, 56, zlib.crc32(body))
    struct.pack_into("<I", trailer, 60, zlib.crc32(bytes(trailer[:60])))
    bad = tmp_path / "two-streams.slot"
    bad.write_bytes(body + bytes(trailer))
    four = make_engine("qwen35", n_slots=4)
    four.generate(1, greedy(PROMPT, 2))
    with pytest.raises(native.SlotFileError) as err:
        four.restore_slot(1, str(bad))
    assert err.value.kind == "shape_mismatch"
    assert four.slot_tokens(1) == [], "a failed restore must leave the slot empty"
    assert four.generate(1, greedy(PROMPT[:50], 2)).timings.prompt_n == 50  # and it keeps serving

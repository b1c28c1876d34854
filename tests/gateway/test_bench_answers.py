"""The benchmarks' typed reading of server answers (`gateway.bench.harness.answers`) and their
reports' JSON: what a bench reads is checked where it is read, an answer's message comes back as it
was sent, and a report leaves out the parts that did not run (as the dicts it replaced did)."""

from __future__ import annotations

import pytest

from engine_pool.protocol.codec import WireError
from gateway.bench.harness.answers import chat_answer, timed, timings
from gateway.bench.storage import StorageReport, Transfer

TIMINGS = {"cache_n": 3, "prompt_n": 7, "prompt_ms": 12, "predicted_n": 2, "predicted_ms": 4.5}


def test_a_chat_answer_keeps_its_message_and_reads_its_counts() -> None:
    message = {"role": "assistant", "content": "hi", "reasoning_content": "think", "extra": [1]}
    answer = chat_answer(
        {
            "choices": [{"index": 0, "message": message}],
            "usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 0}},
            "timings": TIMINGS,
        }
    )
    assert answer.message == message  # sent back unchanged in the next turn
    assert (answer.content, answer.prompt_tokens(), answer.cached_tokens) == ("hi", 9, 0)
    t = answer.timed()
    assert (t.prompt_n, t.prompt_ms, t.predicted_n, t.cache_n) == (7, 12.0, 2, 3)


def test_what_an_answer_leaves_out_reads_as_absent() -> None:
    answer = chat_answer({"choices": []})
    assert (answer.content, answer.cached_tokens, answer.timings) == ("", None, None)
    with pytest.raises(WireError, match="usage.prompt_tokens"):
        answer.prompt_tokens()
    with pytest.raises(WireError, match="timings"):
        answer.timed()
    assert timings({"timings": {}}) is None
    older = timings({"timings": {k: v for k, v in TIMINGS.items() if k != "cache_n"}})
    assert older is not None and older.cache_n is None


def test_a_count_of_the_wrong_type_is_named() -> None:
    with pytest.raises(WireError, match="'timings.prompt_n' must be an integer"):
        timed({"timings": {**TIMINGS, "prompt_n": "7"}})
    with pytest.raises(WireError, match="must be an object"):
        chat_answer([])


def test_a_report_leaves_out_the_parts_that_did_not_run() -> None:
    assert StorageReport("local").to_json() == {"backend": "local"}
    transfer = Transfer(10, 8, 4, True, {"ours_up": 1.0}, {"upload": 0.9}, 0.7)
    assert StorageReport("moto", transfer=transfer).to_json() == {
        "backend": "moto",
        "transfer": {
            "bytes": 10,
            "part_size_mib": 8,
            "concurrency": 4,
            "fsync": True,
            "mb_per_s": {"ours_up": 1.0},
            "ratio": {"upload": 0.9},
            "target": 0.7,
        },
    }

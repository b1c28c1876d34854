"""Reading chat completions and chunk streams: every key beyond OpenAI's shape is optional."""

from __future__ import annotations

from engine_pool.protocol.chat_result import (
    CallArgs,
    CallStart,
    ChunkReader,
    Finish,
    Reasoning,
    Text,
    Usage,
    UsageSeen,
    read_completion,
    read_usage,
)

from .conftest import chunks_of, completion


def test_a_completion_with_every_optional_key() -> None:
    chat = completion(
        "hello",
        reasoning="think",
        calls=[("call_1", "f", '{"a": 1}')],
        prompt=30,
        completion_tokens=7,
        cached=12,
        reasoning_tokens=2,
    )
    chat["choices"][0]["stopping_word"] = "END"
    r = read_completion(chat)
    assert (r.content, r.reasoning, r.finish_reason, r.stopping_word) == (
        "hello",
        "think",
        "tool_calls",
        "END",
    )
    assert [(c.id, c.name, c.arguments) for c in r.calls] == [("call_1", "f", '{"a": 1}')]
    assert r.usage == Usage(prompt_tokens=30, completion_tokens=7, cached_tokens=12, reasoning_tokens=2)


def test_a_bare_completion_reads_as_empty_defaults() -> None:
    r = read_completion({"choices": [{"message": {"content": None}, "finish_reason": "length"}]})
    assert (r.content, r.reasoning, r.calls, r.stopping_word, r.finish_reason) == ("", "", [], "", "length")
    assert r.usage == Usage()
    assert read_usage({"prompt_tokens": True, "completion_tokens": "3"}) == Usage()  # not counts


def test_a_call_without_id_gets_one() -> None:
    r = read_completion({"choices": [{"message": {"tool_calls": [{"function": {"name": "f"}}]}}]})
    assert r.calls[0].id.startswith("call_") and r.calls[0].arguments == "{}"


def test_chunks_become_pieces_in_order() -> None:
    chat = completion("abcdef", reasoning="xy", calls=[("call_9", "g", '{"k": 2}')], cached=4)
    reader = ChunkReader()
    pieces = [p for c in chunks_of(chat, piece=4) for p in reader.feed(c)]
    assert pieces == [
        Reasoning("xy"),
        Text("abcd"),
        Text("ef"),
        CallStart(0, "call_9", "g"),
        CallArgs(0, '{"k": 2}'),
        Finish("tool_calls", ""),
        UsageSeen(Usage(prompt_tokens=20, completion_tokens=5, cached_tokens=4)),
    ]
    assert reader.model == "engine-model"


def test_argument_fragments_in_the_head_delta_and_other_choices() -> None:
    reader = ChunkReader()
    head = {"index": 1, "id": "c", "function": {"name": "f", "arguments": '{"a"'}}
    chunk = {
        "choices": [{"index": 0, "delta": {"tool_calls": [head]}}, {"index": 1, "delta": {"content": "no"}}]
    }
    assert reader.feed(chunk) == [CallStart(1, "c", "f"), CallArgs(1, '{"a"')]
    more = {
        "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 1, "function": {"arguments": ": 1}"}}]}}]
    }
    assert reader.feed(more) == [CallArgs(1, ": 1}")]
    assert reader.feed(
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "stopping_word": "S"}]}
    ) == [Finish("stop", "S")]

"""Implicit routing digests."""

from __future__ import annotations

from gateway.prefixes import lookup_digests, prefix_digests, turn_digests

SYS = {"role": "system", "content": "You are terse."}


def test_resent_history_finds_the_recorded_turn_whatever_the_serialisation():
    history = [SYS, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    recorded = set(turn_digests(history, "m"))
    resent = [
        SYS,
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "hello", "tool_calls": []},
        {"role": "user", "content": "next"},
    ]
    assert lookup_digests(resent, "m")[0] in recorded


def test_only_complete_turns_are_recorded_and_models_and_content_separate_sessions():
    first = [SYS, {"role": "user", "content": "hi"}]
    assert turn_digests(first, "m") == []
    a = [*first, {"role": "assistant", "content": "x"}]
    b = [*first, {"role": "assistant", "content": "y"}]
    assert turn_digests(a, "m") != turn_digests(b, "m")
    assert turn_digests(a, "m") != turn_digests(a, "other")


def test_tool_call_arguments_compare_as_json():
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1, "b": 2}'}}
    same = {"id": "2", "type": "function", "function": {"name": "f", "arguments": '{"b":2,"a":1}'}}
    m1 = [SYS, {"role": "assistant", "content": None, "tool_calls": [call]}]
    m2 = [SYS, {"role": "assistant", "content": "", "tool_calls": [same]}]
    assert prefix_digests(m1, "m") == prefix_digests(m2, "m")

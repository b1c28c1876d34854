"""Implicit routing digests."""

from __future__ import annotations

from gateway.turn.prompt import lookup_digests, prefix_digests, shared_digest, system_digest, turn_digests

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


def test_the_shared_prefix_is_tools_and_leading_system_messages():
    tools = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
    a = [SYS, {"role": "user", "content": "first task"}]
    b = [SYS, {"role": "user", "content": "another task"}, {"role": "assistant", "content": "x"}]
    assert shared_digest(a, tools, "m") == shared_digest(b, tools, "m")
    assert shared_digest(a, tools, "m") != shared_digest(a, None, "m")
    assert shared_digest(a, tools, "m") != shared_digest(a, tools, "other")
    assert shared_digest([{"role": "system", "content": "other"}, *a[1:]], tools, "m") != shared_digest(
        a, tools, "m"
    )
    reordered = [{"function": {"parameters": {"type": "object"}, "name": "read"}, "type": "function"}]
    assert shared_digest(a, reordered, "m") != shared_digest(a, tools, "m")  # templates render that order
    dev = [{"role": "developer", "content": "d"}, SYS, {"role": "user", "content": "u"}]
    assert shared_digest(dev, None, "m") != shared_digest(dev[1:], None, "m")
    assert shared_digest([{"role": "user", "content": "u"}], None, "m") is None  # nothing shared


def test_the_system_digest_scopes_an_agents_conversations_by_their_system_prompt():
    a = [SYS, {"role": "user", "content": "task"}]
    parts = [{"role": "system", "content": [{"type": "text", "text": "You are terse."}]}, a[1]]
    assert system_digest(a) == system_digest(parts) == system_digest([SYS, {"role": "user", "content": "x"}])
    assert system_digest([{"role": "system", "content": "You are a sub-agent."}, a[1]]) != system_digest(a)
    assert system_digest([{"role": "user", "content": "no system"}]) is None


def test_what_a_prompt_adds_to_its_sessions_state_is_bounded_before_any_tokenizer():
    from gateway.turn.prompt import TEMPLATE_TOKENS, Prompt, tokens_at_most

    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "List the sensors."}]
    reply = {"role": "assistant", "content": "Sensor 1 and sensor 2."}
    output = "row: 23.5 °C\n" * 400  # a tool's output, non-ASCII included
    turn2 = [*first, reply, {"role": "user", "content": output}]
    head = Prompt(first, "m", {}).head
    assert head is not None
    added = Prompt(turn2, "m", {}).added_at_most(head)
    # Every byte of the new message's text, and the template's wrapping.
    assert added == len(output.encode()) + 2 * TEMPLATE_TOKENS
    calls = [{"function": {"name": "f", "arguments": "{}"}}]
    called = [*turn2, {"role": "assistant", "content": None, "tool_calls": calls}]
    result = {"role": "tool", "content": "ok", "tool_call_id": "c1"}
    # The reply with its call is in the state already: the tool's result and its call's id are new.
    assert Prompt([*called, result], "m", {}).added_at_most(Prompt(turn2, "m", {}).head or "") == 36
    assert tokens_at_most(called[-1:]) == 3 * TEMPLATE_TOKENS + 1 + 2 * 2  # a call: its name, its arguments
    thought = {"role": "assistant", "content": "Yes.", "reasoning_content": "Check twice."}
    assert tokens_at_most([thought]) == 2 * TEMPLATE_TOKENS + 4 + 12  # its reasoning counts too
    assert Prompt(first, "m", {}).added_at_most(head) == 0  # the same prompt again
    assert Prompt(turn2, "m", {}, tools=[{"type": "function"}]).added_at_most(head) is None  # other tools
    other = [*first[:1], {"role": "user", "content": "Something else."}, reply, turn2[-1]]
    assert Prompt(other, "m", {}).added_at_most(head) is None  # it does not go on from that state

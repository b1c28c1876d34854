"""formats/reasoning.py and formats/output.py: `<think>` blocks split from the content (also when the
prompt opened them), the --reasoning-format modes, calls read from the content only, and the grammar
prefix that lets a model finish an open block."""

from __future__ import annotations

import json

import pytest

from engine_pool.http.body import Body
from engine_pool.server.chat_request import constraint, parse_chat
from engine_pool.server.formats import FORMATS, ChatMessage, ChatOutput, assemble, opened_by
from engine_pool.server.formats.reasoning import Markup, Reasoning, ReasoningStream
from engine_pool.server.limits import RequestLimits
from engine_pool.server.sampling import Sampling
from native import Engine

from .conftest import Accepts, Generate, chunkings, read_whole, token_of

CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


def read(text: str, *, opened: bool, mode: str = "auto", tools: bool = True) -> ChatMessage:
    return read_whole(ChatOutput(FORMATS["hermes"].stream([]) if tools else None, mode, opened), text)


@pytest.mark.parametrize(
    ("prompt", "opened"),
    [
        ("<|im_start|>assistant\n<think>\n", True),
        ("<|im_start|>assistant\n<think>", True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # enable_thinking false
        ("<|im_start|>assistant\n<think></think>", False),
        ("<|im_start|>assistant\n", False),
    ],
)
def test_an_open_block_is_read_from_the_prompt_tail(prompt: str, opened: bool) -> None:
    assert opened_by(prompt) is opened


def test_reasoning_the_model_opens() -> None:
    msg = read("\n<think>\n  Let me think.\n\nStill.  \n</think>\n\nThe answer.", opened=False)
    assert (msg.reasoning, msg.content, msg.calls) == ("Let me think.\n\nStill.", "The answer.", [])


def test_reasoning_the_prompt_opened() -> None:
    msg = read("The user wants f.\n</think>\n\n" + CALL, opened=True)
    assert (msg.reasoning, msg.content) == ("The user wants f.", None)
    assert [(c.name, json.loads(c.arguments)) for c in msg.calls] == [("f", {"a": 1})]


def test_calls_inside_the_reasoning_are_not_calls() -> None:
    msg = read("I could write " + CALL + " but</think>no.", opened=True)
    assert msg.calls == [] and msg.content == "no." and CALL in msg.reasoning


def test_an_unclosed_block_is_all_reasoning() -> None:
    # (A reply without calls has text, empty here, never null: issue 45.)
    assert read("thinking on and on </thi", opened=True) == ChatMessage("", "thinking on and on </thi", [])
    assert read("<think>half", opened=False) == ChatMessage("", "half", [])


def test_reasoning_only_at_the_start() -> None:
    text = "Answer first. <think>not reasoning</think>"
    assert read(text, opened=False) == ChatMessage(text, "", [])
    assert read("  <thin", opened=False) == ChatMessage("  <thin", "", [])


def test_reasoning_formats() -> None:
    text = "<think>\nplan\n</think>\n\n" + CALL
    none = read(text, opened=False, mode="none")
    assert (none.reasoning, len(none.calls)) == ("", 1) and none.content == "<think>\nplan\n</think>"
    legacy = read(text, opened=False, mode="deepseek-legacy")
    assert (
        legacy.reasoning == "plan" and legacy.content == "<think>\nplan\n</think>" and len(legacy.calls) == 1
    )
    plain = read("<think>plan</think>answer", opened=False, mode="deepseek-legacy", tools=False)
    assert plain == ChatMessage("<think>plan</think>answer", "plan", [])
    for mode in ("auto", "deepseek"):
        assert read(text, opened=False, mode=mode).reasoning == "plan"


@pytest.mark.parametrize("opened", [False, True])
def test_random_chunkings_give_the_whole_result(opened: bool) -> None:
    text = ("" if opened else " <think>") + "\n a </thin b \n\n c \n</think>\n\n  Done. <tool_call" + CALL
    for mode in ("auto", "deepseek-legacy", "none"):
        whole = read(text, opened=opened, mode=mode)
        for deltas in chunkings(text, seed=4, n=20):
            out = ChatOutput(FORMATS["hermes"].stream([]), mode, opened)
            pieces = [p for d in deltas for p in out.feed(d)] + out.finish()
            msg = assemble(pieces)
            assert (msg.content, msg.reasoning) == (whole.content, whole.reasoning)
            assert [c.arguments for c in msg.calls] == [c.arguments for c in whole.calls]


def test_the_stream_holds_back_only_what_may_be_a_tag() -> None:
    s = ReasoningStream(opened=False)
    assert s.feed("  <thi") == []
    assert s.feed("nk>\nidea ") == [Markup("  <think>"), Markup("\n"), Reasoning("idea")]
    assert s.feed(" more</th") == [Reasoning("  more")]
    assert s.feed("ink>\n\nok") == [Markup("</think>"), Markup("\n\n"), "ok"]
    assert s.finish() == []


def test_reasoning_tokens_count_what_arrived_inside_the_block() -> None:
    out = ChatOutput(None, "auto", opened=True)
    for text in ("a", " b", "</think>", "\n", "answer"):
        out.feed(text, 1)
    assert out.reasoning_tokens == 3  # "a", " b" and the token that closed the block
    assert ChatOutput(None, "none", opened=True).reasoning_tokens == 0


def test_grammar_lets_the_model_finish_an_open_block(accepts: Accepts) -> None:
    grammar = FORMATS["hermes"].grammar([("f", {})], reasoning=True)
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert accepts(grammar, "some <b>reasoning</b>\n</think>\n\n" + call)
    assert accepts(grammar, "</think>" + call)
    assert not accepts(grammar, call)  # the block is open: it must be closed first
    assert not accepts(grammar, "a</think>b</think>" + call)


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
    ],
)
def test_json_output_comes_after_an_open_block(accepts: Accepts, response_format: dict[str, object]) -> None:
    body = Body({"messages": [{"role": "user", "content": "hi"}], "response_format": response_format})
    req = parse_chat(body, Sampling(), RequestLimits(), n_vocab=1024, n_ctx=4096)
    grammar = constraint(req, reasoning=True).grammar
    assert accepts(grammar, 'Plan.</think>\n{"a": 1}')
    assert not accepts(grammar, '{"a": 1}')
    assert accepts(constraint(req).grammar, '{"a": 1}')


def test_a_model_under_the_prefix_reasons_then_calls(generate: Generate, format_engine: Engine) -> None:
    """A bias on `</think>` (one token here) ends the random model's reasoning soon; what it wrote
    before is reasoning, the rest the forced call."""
    grammar = FORMATS["qwen-xml"].grammar([("ping", {})], reasoning=True)
    bias = {token_of(format_engine, "</think>"): 4.0}
    for seed in range(3):
        out = generate(grammar, seed, bias=bias)
        assert out.stop_reason == "eos", out.text
        msg = read_xml(out.text)
        assert [c.name for c in msg.calls] == ["ping"] and msg.content is None


def read_xml(text: str) -> ChatMessage:
    return read_whole(ChatOutput(FORMATS["qwen-xml"].stream([]), "auto", opened=True), text)

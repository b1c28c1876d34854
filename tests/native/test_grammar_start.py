"""How a grammar starts (RequestParams.grammar_lazy / grammar_trigger_* / grammar_prefill), the two
ways llama.cpp's chat layer constrains tool calls: a lazy grammar lets the model write freely until a
trigger (a pattern over the generated text, or a token) and constrains what follows; a prefilled
grammar has already read the generation prompt the template wrote, so it goes on from there."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import native

Make = Callable[..., native.Engine]
Greedy = Callable[..., native.RequestParams]


def test_a_lazy_grammar_leaves_the_text_free_until_its_trigger_token(
    make_engine: Make, greedy: Greedy
) -> None:
    eng = make_engine("llama")
    # A token the model writes on its own after others it has not written before it.
    for word in ("Paris", "Oslo", "Rome", "Lima", "Kyiv", "Bern"):
        prompt = eng.tokenize(f"The weather in {word} is", True)
        free = eng.generate(0, greedy(prompt, 12))
        at = next((i for i, t in enumerate(free.tokens) if i > 0 and t not in free.tokens[:i]), None)
        if at is not None:
            break
    assert at is not None, "no prompt made the model write two different tokens"
    trigger = free.tokens[at]
    trigger_text = eng.token_piece(trigger).decode()
    lazy = eng.generate(
        0,
        greedy(
            prompt,
            at + 8,
            grammar=f"root ::= {_gbnf(trigger_text)} [0-9] [0-9] [0-9]",
            grammar_lazy=True,
            grammar_trigger_tokens=[trigger],
        ),
    )
    # Free up to the trigger (the same tokens as unconstrained), then exactly what the grammar allows.
    assert lazy.tokens[: at + 1] == free.tokens[: at + 1]
    rest = eng.detokenize(lazy.tokens[at + 1 :])
    assert len(rest) == 3 and rest.isdigit(), rest
    assert lazy.stop_reason in ("eos", "stop_token"), lazy.stop_reason


def test_a_lazy_grammar_triggers_on_a_pattern_over_the_text(make_engine: Make, greedy: Greedy) -> None:
    eng = make_engine("llama")
    prompt = eng.tokenize("The weather in Paris is", True)
    free = eng.generate(0, greedy(prompt, 12))
    head = eng.detokenize(free.tokens[:2])
    lazy = eng.generate(
        0,
        greedy(
            prompt,
            12,
            grammar=f"root ::= {_gbnf(head)} [0-9] [0-9]",
            grammar_lazy=True,
            grammar_trigger_patterns=["^" + _regex(head)],
        ),
    )
    text = eng.detokenize(lazy.tokens)
    assert text.startswith(head) and text[len(head) :].isdigit() and len(text) == len(head) + 2, text


def test_a_prefilled_grammar_goes_on_from_the_generation_prompt(make_engine: Make, greedy: Greedy) -> None:
    eng = make_engine("llama")
    prompt = eng.tokenize("Answer:", True)
    prefill = eng.tokenize(" yes or", False)
    grammar = 'root ::= " yes or" (" no" | " maybe")'
    done = eng.generate(0, greedy(prompt, 8, grammar=grammar, grammar_prefill=prefill))
    assert eng.detokenize(done.tokens) in (" no", " maybe")


def test_a_prefill_the_grammar_refuses_is_the_requests_fault(make_engine: Make, greedy: Greedy) -> None:
    eng = make_engine("llama")
    prompt = eng.tokenize("Answer:", True)
    with pytest.raises(native.InvalidRequestError, match="refuses the generation prompt"):
        eng.generate(
            0, greedy(prompt, 4, grammar='root ::= "A" "B"', grammar_prefill=eng.tokenize("zzz", False))
        )
    with pytest.raises(native.InvalidRequestError, match="trigger"):
        eng.generate(0, greedy(prompt, 4, grammar='root ::= "A"', grammar_lazy=True))
    # The engine serves on.
    assert eng.generate(0, greedy(prompt, 2)).tokens


def _gbnf(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _regex(text: str) -> str:
    import re

    return re.escape(text)

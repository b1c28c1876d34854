"""Stop strings in the core (RequestParams.stop_strings): generation ends on the token that
completes one, in the same loop step, so what the slot holds never depends on when the caller reads
the events (a stop matched only by the reader let the core run on until its cancel arrived)."""

from __future__ import annotations

from collections.abc import Callable

import native

Make = Callable[..., native.Engine]
Greedy = Callable[..., native.RequestParams]


def test_generation_ends_on_the_token_completing_a_stop_string(make_engine: Make, greedy: Greedy) -> None:
    eng = make_engine("qwen35")
    prompt = eng.tokenize("Once upon a time", True)
    free = eng.generate(0, greedy(prompt, 16))
    # A stop string spanning two pieces: the end of one and the next one whole (both valid UTF-8:
    # a byte inside a character cannot be written in a stop string).
    k = next(
        i
        for i in range(2, len(free.pieces))
        if all(_text(free.pieces[j]) is not None and free.pieces[j] for j in (i - 1, i))
    )
    stop = str(_text(free.pieces[k - 1]))[-1:] + str(_text(free.pieces[k]))
    seen = [b"".join(free.pieces[:i]) for i in range(len(free.pieces) + 1)]
    first_at = next(i for i, t in enumerate(seen) if stop.encode() in t)
    for _ in range(3):  # the same every time
        done = eng.generate(0, greedy(prompt, 16, stop_strings=["never there", stop]))
        assert done.stop_reason == "stop_word"
        assert done.tokens == free.tokens[:first_at]
        # The completing token was sampled, not evaluated: the slot holds the prompt and the rest.
        assert len(eng.slot_tokens(0)) == len(prompt) + first_at - 1


def test_no_stop_string_leaves_generation_as_it_was(make_engine: Make, greedy: Greedy) -> None:
    eng = make_engine("llama")
    prompt = eng.tokenize("Once upon a time", True)
    free = eng.generate(0, greedy(prompt, 12))
    again = eng.generate(0, greedy(prompt, 12, stop_strings=["\x00never"]))
    assert again.tokens == free.tokens and again.stop_reason == free.stop_reason == "length"


def _text(piece: bytes) -> str | None:
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return None

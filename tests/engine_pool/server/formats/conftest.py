"""Judges for the chat formats: llama.cpp's own grammar sampler, and a tiny model writing under a grammar.

`accepts(grammar, text)` asks llama.cpp's grammar sampler, token by token, whether `text` is a
complete sentence of `grammar` (each token must survive the sampler, then end-of-generation must).
`generate(grammar, seed)` lets a random-weight model write under the grammar in-process, so that
what the grammar admits is also what a model writes.
"""

from __future__ import annotations

import ctypes
import json
import math
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import llama_cpp.llama_cpp as llama
import pytest

import native
from engine_pool.server.formats import CallStream, ChatMessage, ChatOutput, assemble

Accepts = Callable[[str, str], bool]
Generate = Callable[..., native.Completion]


@pytest.fixture(scope="session")
def format_model(tiny_model: Callable[..., str]) -> Path:
    return Path(tiny_model("qwen35"))


@pytest.fixture(scope="session")
def accepts(format_model: Path) -> Iterator[Accepts]:
    llama.llama_backend_init()
    params = llama.llama_model_default_params()
    params.vocab_only = True
    model = llama.llama_model_load_from_file(str(format_model).encode(), params)
    assert model
    vocab = llama.llama_model_get_vocab(model)
    eos = llama.llama_vocab_eos(vocab)

    def tokenize(text: str) -> list[int]:
        data = text.encode()
        buf = (llama.llama_token * (len(data) + 8))()
        n = llama.llama_tokenize(vocab, data, len(data), buf, len(buf), False, True)
        assert n >= 0
        return list(buf[:n])

    def check(grammar: str, text: str) -> bool:
        sampler = llama.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
        assert sampler, f"llama.cpp refused the grammar:\n{grammar}"
        try:
            for token in [*tokenize(text), eos]:
                cell = (llama.llama_token_data * 1)(llama.llama_token_data(token, 0.0, 0.0))
                candidates = llama.llama_token_data_array(cell, 1, -1, False)
                llama.llama_sampler_apply(sampler, ctypes.byref(candidates))
                if math.isinf(cell[0].logit):
                    return False
                if token != eos:
                    llama.llama_sampler_accept(sampler, token)
            return True
        finally:
            llama.llama_sampler_free(sampler)

    try:
        yield check
    finally:
        llama.llama_model_free(model)


@pytest.fixture(scope="session")
def format_engine(format_model: Path) -> Iterator[native.Engine]:
    config = native.EngineConfig(str(format_model), n_slots=1, n_ctx=2048, n_threads=1)
    with closing(native.Engine(config)) as eng:
        yield eng


@pytest.fixture(scope="session")
def generate(format_engine: native.Engine) -> Generate:
    def run(
        grammar: str, seed: int, *, n: int = 600, bias: dict[int, float] | None = None
    ) -> native.Completion:
        p = native.RequestParams(format_engine.tokenize("Hello world the model"))
        p.n_predict, p.temperature, p.seed, p.grammar = n, 1.0, seed, grammar
        p.logit_bias = bias or {}
        return format_engine.generate(0, p)

    return run


def weather_schema(**more: Any) -> dict[str, Any]:
    """get_weather's parameters in the grammar tests: `city` (at most 10 characters) and `unit` are
    required, `days` and the properties in `more` are optional."""
    return {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 10},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer"},
            **more,
        },
        "required": ["city", "unit"],
    }


def function_tool(
    name: str, properties: dict[str, Any], required: Sequence[str], description: str | None = None
) -> dict[str, Any]:
    """A chat request's `tools` entry: the function `name` taking an object of `properties`."""
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    function["parameters"] = {"type": "object", "properties": properties, "required": list(required)}
    return {"type": "function", "function": function}


def chunkings(text: str, seed: int, n: int = 30) -> Iterator[list[str]]:
    """`n` random ways to cut `text` into deltas (single characters and empty deltas included)."""
    rng = random.Random(seed)
    for _ in range(n):
        cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(0, len(text))))
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def token_of(engine: native.Engine, text: str) -> int:
    (token,) = engine.tokenize(text, False, True)
    return token


def read_whole(stream: CallStream | ChatOutput, text: str) -> ChatMessage:
    """What `stream` makes of `text` fed in one piece."""
    return assemble(stream.feed(text) + stream.finish())


def named_arguments(msg: ChatMessage) -> list[tuple[str, Any]]:
    """Each call of `msg` as (name, its arguments decoded from JSON)."""
    return [(c.name, json.loads(c.arguments)) for c in msg.calls]


def assert_chunkings_read_as_whole(new_stream: Callable[[], CallStream], text: str, seed: int) -> None:
    """`text` fed to a fresh stream in each of `chunkings(text, seed)` gives the content and calls
    that it gives fed whole."""
    whole = read_whole(new_stream(), text)
    for deltas in chunkings(text, seed):
        s = new_stream()
        msg = assemble([piece for d in deltas for piece in s.feed(d)] + s.finish())
        assert msg.content == whole.content
        assert [(c.name, c.arguments) for c in msg.calls] == [(c.name, c.arguments) for c in whole.calls]

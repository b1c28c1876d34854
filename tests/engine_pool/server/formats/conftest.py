"""Judges for the chat formats: llama.cpp's own grammar sampler, and a tiny model writing under a grammar.

`accepts(grammar, text)` asks llama.cpp's grammar sampler, token by token, whether `text` is a
complete sentence of `grammar` (each token must survive the sampler, then end-of-generation must).
`generate(grammar, seed)` lets a random-weight model write under the grammar in-process, so that
what the grammar admits is also what a model writes.
"""

from __future__ import annotations

import ctypes
import math
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import llama_cpp.llama_cpp as llama
import pytest

import native
from native.model_gen import write_model

Accepts = Callable[[str, str], bool]
Generate = Callable[..., native.Completion]


@pytest.fixture(scope="session")
def format_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("formats") / "qwen35.gguf"
    write_model(path, "qwen35", size="tiny", seed=0)
    return path


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
    eng = native.Engine(native.EngineConfig(str(format_model), n_slots=1, n_ctx=2048, n_threads=1))
    yield eng
    eng.close()


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


def pieces_of(
    feed: Callable[[str], list[Any]], finish: Callable[[], list[Any]], deltas: list[str]
) -> list[Any]:
    out: list[Any] = []
    for d in deltas:
        out += feed(d)
    return out + finish()

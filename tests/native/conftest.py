"""Engines over the tiny models, and the sync helpers the native tests share."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import jinja2.sandbox
import pytest

import native

SLOT_CTX = 1024  # tokens per slot in every test engine


@pytest.fixture
def make_engine(tiny_model: Callable[..., str]) -> Iterator[Callable[..., native.Engine]]:
    """`make_engine(arch, n_slots=1, **config)`: a fresh engine (a restart, when called again)."""
    engines: list[native.Engine] = []

    def make(arch: str, n_slots: int = 1, seed: int = 0, **kw: object) -> native.Engine:
        opts: dict[str, object] = {
            "n_slots": n_slots,
            "n_ctx": SLOT_CTX * n_slots,
            "n_batch": 256,
            "n_threads": 2,
            "checkpoint_interval": 96,
            "checkpoint_min_step": 16,
        }
        opts.update(kw)
        eng = native.Engine(native.EngineConfig(tiny_model(arch, seed), **opts))
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.close()


def _greedy(prompt: list[int], n_predict: int = 12, **kw: object) -> native.RequestParams:
    p = native.RequestParams(prompt)
    p.n_predict = n_predict
    p.temperature = 0.0
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def _render(template: str, messages: list[dict[str, object]], add_generation_prompt: bool) -> str:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, bos_token="", eos_token=""
    )


@pytest.fixture
def greedy() -> Callable[..., native.RequestParams]:
    """`greedy(prompt, n_predict=12, **fields)`: deterministic request parameters."""
    return _greedy


@pytest.fixture
def render() -> Callable[[str, list[dict[str, object]], bool], str]:
    """`render(template, messages, add_generation_prompt)`: the GGUF chat template with jinja2."""
    return _render

"""Fixtures shared by every suite: tiny random-weight models generated once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

ARCHS = ["llama", "gemma2", "mamba2", "lfm2", "qwen35"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """`tiny_model(arch, seed=0)` → path of a generated tiny GGUF (written once per session)."""
    from native.model_gen import write_model

    root = tmp_path_factory.mktemp("models")
    cache: dict[tuple[str, int], str] = {}

    def get(arch: str, seed: int = 0) -> str:
        key = (arch, seed)
        if key not in cache:
            path = Path(root) / f"{arch}-seed{seed}.gguf"
            write_model(str(path), arch, size="tiny", seed=seed)
            cache[key] = str(path)
        return cache[key]

    return get

"""The ``files`` fixture of the chunking tests: one set of slot files per tiny architecture."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from support.chunk_files import ARCHS, Files, make_files


@pytest.fixture(scope="package")
def files(tiny_model: Callable[..., str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Files]:
    """Per architecture (and ``llama-fa``: flash attention, so V is not transposed)."""
    root = tmp_path_factory.mktemp("chunking")
    out = {arch: make_files(tiny_model(arch), root / arch) for arch in ARCHS}
    out["llama-fa"] = make_files(tiny_model("llama"), root / "llama-fa", flash_attn=True)
    return out

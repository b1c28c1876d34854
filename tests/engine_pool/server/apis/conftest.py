"""An engine process that demands an API key, for the Responses and Messages route tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ...conftest import EngineProcess, run_engine

API_KEY = "apis-test-key"


@pytest.fixture(scope="session")
def keyed_engine(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    """The tiny Qwen-template model (tools in its template), 2 slots, an API key."""
    yield from run_engine(
        tmp_path_factory,
        models["qwen35"],
        *("-np", "2", "-c", "2048", "-a", "tiny-qwen"),
        env={"SLOTKEEPER_API_KEY": API_KEY},
        timeout_s=180.0,  # a loaded CI machine can take a while to map the model
    )

"""An engine with small request limits, shared by the limit tests (test_limits_*.py).

The limits are small so that each one is reached with a few kilobytes, and the schema budget is
large so that a schema can take a noticeable time to convert (test_limits_grammar's event loop
test). Logs at debug level: the tests read `grammar.building` from them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ..conftest import EngineProcess, run_engine

LIMITED_ARGS = {
    "--parallel": "1",
    "--ctx-size": "4096",
    "--queue-size": "1",
    "--max-body-bytes": "4M",
    "--body-timeout-s": "1",
    "--max-json-depth": "16",
    "--max-messages": "4",
    "--max-tools": "2",
    "--max-text-chars": "2000",
    "--max-stop": "2",
    "--max-stop-chars": "8",
    "--max-logit-bias": "3",
    "--max-grammar-bytes": "256K",
    "--max-grammar-depth": "64",
    "--max-schema-depth": "8",
    "--max-schema-grammar-bytes": "64M",
    "--max-schema-grammar-rules": "1000000",
    "--log-level": "debug",
}


@pytest.fixture(scope="session")
def limited_engine(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    yield from run_engine(tmp_path_factory, models["llama"], *[a for kv in LIMITED_ARGS.items() for a in kv])


@pytest.fixture
def limited(limited_engine: EngineProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=limited_engine.url, timeout=60.0) as client:
        yield client

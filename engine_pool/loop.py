"""The event loop our processes run on: uvloop where it is installed (as uvicorn's own `run` picks
with `loop="auto"`), else asyncio's. Entry points that drive uvicorn through `Server.serve()` call
`run` instead of `asyncio.run`, so they get the same loop as the engines (`Server.run`)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on the platforms it supports
        return asyncio.run(main)
    return uvloop.run(main)

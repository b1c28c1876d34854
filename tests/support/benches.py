"""Loading one bench module from another: they are loaded by path (`slotkeeper bench NAME`), not as
a package, so a bench that uses another's drivers loads it by its file name, once."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


def sibling(name: str) -> ModuleType:
    """tests/bench/NAME.py as a module (the one already loaded under that name, if any)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

"""`slotkeeper bench NAME [ARGS]`: run tests/bench/bench_NAME.py's main(argv) from a source checkout.

Benchmarks are not part of the installed package (they need generated models and minutes of CPU);
they live beside the tests and are found from the current directory or the package's checkout.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _bench_dir() -> Path | None:
    here = Path(__file__).resolve().parent.parent / "tests" / "bench"
    for candidate in (Path.cwd() / "tests" / "bench", here):
        if candidate.is_dir():
            return candidate
    return None


def main(argv: list[str]) -> int:
    root = _bench_dir()
    if root is None:
        print("slotkeeper bench: tests/bench not found; run it from a Slotkeeper checkout", file=sys.stderr)
        return 2
    names = sorted(p.stem.removeprefix("bench_") for p in root.glob("bench_*.py"))
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: slotkeeper bench NAME [ARGS...]\n\nbenchmarks: " + ", ".join(names))
        return 0 if argv else 2
    name = argv[0].replace("-", "_")  # `upstream-suite` names bench_upstream_suite.py
    if name not in names:
        print(f"slotkeeper bench: no benchmark {name!r} (have: {', '.join(names)})", file=sys.stderr)
        return 2
    if str(root.parent) not in sys.path:  # the benchmarks use the test suites' helpers (tests/support)
        sys.path.insert(0, str(root.parent))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", root / f"bench_{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return int(module.main(argv[1:]) or 0)

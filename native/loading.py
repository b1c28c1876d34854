"""Why the compiled module `native._native` cannot be loaded, in one line a person can act on.

The usual cause is a source tree that hides the installed package: Python started with `-m` (or a
script) in the repository root puts that directory first on `sys.path`, and its `native/` holds the
C++ sources, not the module a non-editable `pip install .` built into site-packages. Engines are
started with `python -P` for that reason; this message is for everything else that imports it.
"""

from __future__ import annotations

from pathlib import Path


def explain_missing_module(package_file: str, exc: ImportError) -> str:
    """The message of the ImportError raised when `native._native` does not load from the package
    whose `__init__.py` is `package_file`."""
    here = Path(package_file).resolve().parent
    said = " ".join(str(exc).split())
    if (here / "CMakeLists.txt").is_file() and not any(here.glob("_native*.so")):
        return (
            f"slotkeeper's compiled module native._native is not in {here}: that is the source tree's "
            f"native/, which hides the installed package when Python starts in {here.parent} "
            "(`python -m ...` or a script from there) — run the `slotkeeper` command, start Python "
            f"elsewhere or with -P, or install editable (pip install -e .) ({said})"
        )
    return (
        f"slotkeeper's compiled module native._native in {here} cannot be loaded: {said} — reinstall "
        "slotkeeper (pip install .) with the llama-cpp-python version it was built against"
    )

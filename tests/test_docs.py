"""The documentation builds with no warnings, and the architecture picture is what its script draws.

mkdocs is in the `test` extra: without it the build test skips locally and fails under CI=1, so a
CI run never passes without building the docs.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mkdocs_missing() -> bool:
    return importlib.util.find_spec("mkdocs") is None


def test_the_docs_build_strict_without_a_warning(tmp_path: Path) -> None:
    if _mkdocs_missing():
        if os.environ.get("CI"):
            pytest.fail("mkdocs is not installed (the test extra installs it)")
        pytest.skip("mkdocs is not installed (the test extra installs it)")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "WARNING" not in log, log
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "glossary" / "index.html").is_file()


def test_every_page_under_docs_is_in_the_nav() -> None:
    """A page left out of `nav` would build but be unreachable from the site's menu."""
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert pages
    assert [p for p in pages if f": {p}" not in nav] == []


def test_the_architecture_svg_is_what_its_script_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("docs_architecture", ROOT / "docs" / "architecture.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    committed = (ROOT / "docs" / "architecture.svg").read_text(encoding="utf-8")
    assert committed == module.render(), "run `python3 docs/architecture.py` and commit docs/architecture.svg"


def test_the_readme_says_how_to_get_what_builds_the_docs() -> None:
    """The README's build command installs what it runs: the `docs` extra holds the mkdocs the test
    extra builds with."""
    import tomllib

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "optional-dependencies"
    ]
    assert "pip install '.[docs]' && mkdocs build --strict" in readme
    mkdocs = [d for d in extras["docs"] if d.startswith("mkdocs")]
    assert mkdocs and set(mkdocs) <= set(extras["test"])

"""native.loading: a compiled module that does not load is explained in one line that says why."""

from __future__ import annotations

from pathlib import Path

from native.loading import explain_missing_module


def test_a_source_tree_that_hides_the_install_is_named(tmp_path: Path) -> None:
    tree = tmp_path / "repo" / "native"
    tree.mkdir(parents=True)
    (tree / "CMakeLists.txt").write_text("project(x)\n")
    said = explain_missing_module(str(tree / "__init__.py"), ImportError("No module named 'native._native'"))
    assert "\n" not in said
    assert f"is not in {tree}" in said and "source tree" in said and str(tmp_path / "repo") in said
    assert "`slotkeeper` command" in said and "-P" in said and "pip install -e ." in said


def test_an_installed_module_that_fails_to_load_says_its_error(tmp_path: Path) -> None:
    installed = tmp_path / "site-packages" / "native"
    installed.mkdir(parents=True)
    (installed / "_native.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    error = ImportError("libllama.so: cannot open shared object file")
    said = explain_missing_module(str(installed / "__init__.py"), error)
    assert "\n" not in said and "libllama.so: cannot open shared object file" in said
    assert "reinstall slotkeeper" in said

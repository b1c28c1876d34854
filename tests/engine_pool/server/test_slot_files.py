"""engine_pool/server/slot_files.py: slot file names stay inside the slot directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_pool.errors import BadRequest, NotSupported
from engine_pool.server.slot_files import slot_file_path


@pytest.mark.parametrize("name", ["a.slot", "session-1_2.bin", "X" * 255, "a..b"])
def test_plain_names_are_accepted(tmp_path: Path, name: str) -> None:
    assert slot_file_path(tmp_path, name) == tmp_path / name


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("../x", "without directories"),
        ("/etc/passwd", "without directories"),
        ("a/b", "without directories"),
        ("a\\b", "without directories"),
        ("..", "must not start with '.'"),
        (".", "must not start with '.'"),
        (".bashrc", "must not start with '.'"),
        ("a b", "may only contain"),
        ("a\x00b", "may only contain"),
        ("é.slot", "may only contain"),
        ("C:x", "may only contain"),
        ("x" * 256, "longer than 255 bytes"),
        ("", "non-empty string"),
        (None, "non-empty string"),
        (3, "non-empty string"),
    ],
)
def test_odd_names_are_refused(tmp_path: Path, name: object, why: str) -> None:
    with pytest.raises(BadRequest) as exc:
        slot_file_path(tmp_path, name)
    assert why in exc.value.message


def test_a_symlink_out_of_the_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "slots").mkdir()
    (tmp_path / "slots" / "escape").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(BadRequest, match="resolves outside"):
        slot_file_path(tmp_path / "slots", "escape")


def test_disabled_without_a_slot_directory() -> None:
    with pytest.raises(NotSupported, match="--slot-save-path"):
        slot_file_path(None, "a.slot")

"""The shared flags table machinery."""

from __future__ import annotations

import pytest

from engine_pool.flags import Flag, SettingsError, parse_bytes, parse_int, read_flags

FLAGS = (
    Flag("port", ("--port",), "X_PORT", parse_int, "port", required=True),
    Flag("names", ("--name",), "X_NAMES", str, "repeatable", repeat=True),
    Flag("secret", (), "X_SECRET", str, "variable only"),
)


SIZES = [("8Gi", 8 << 30), ("8GiB", 8 << 30), ("8G", 8 << 30), ("512K", 512 << 10), ("100", 100)]


@pytest.mark.parametrize("text, value", SIZES)
def test_byte_sizes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


def test_command_line_beats_environment_and_lists_repeat() -> None:
    env = {"X_PORT": "1", "X_NAMES": "a, b", "X_SECRET": "s"}
    got = read_flags(["--port", "0x10"], env, FLAGS, prog="x", description="")
    assert got == {"port": 16, "names": ("a", "b"), "secret": "s"}
    assert read_flags(["--port", "2", "--name", "c", "--name", "d"], {}, FLAGS, prog="x", description="")[
        "names"
    ] == (
        "c",
        "d",
    )


def test_errors_name_the_flag_or_variable() -> None:
    with pytest.raises(SettingsError, match="--port is required"):
        read_flags([], {}, FLAGS, prog="x", description="")
    with pytest.raises(SettingsError, match="X_PORT: invalid value"):
        read_flags([], {"X_PORT": "nope"}, FLAGS, prog="x", description="")
    with pytest.raises(SettingsError, match="unrecognized arguments: --secret"):
        read_flags(["--port", "1", "--secret", "s"], {}, FLAGS, prog="x", description="")

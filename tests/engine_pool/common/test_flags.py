"""The shared flags table machinery."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine_pool.common.flags import (
    Flag,
    SettingsError,
    check_settings,
    env_name,
    parse_bytes,
    parse_int,
    read_flags,
    table_defaults,
)

FLAGS = (
    Flag("port", ("--port",), parse_int, "port", required=True, variable="X_PORT"),
    Flag("names", ("--name",), str, "repeatable", repeat=True, variable="X_NAMES"),
    Flag("secret", (), str, "variable only", variable="X_SECRET"),
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


def test_a_variable_is_derived_from_its_field_unless_declared() -> None:
    assert env_name("lock_ttl_s") == "SLOTKEEPER_LOCK_TTL_S"
    derived = Flag("lock_ttl_s", ("--lock-ttl-s",), float, "ttl", default=15.0)
    assert derived.env == "SLOTKEEPER_LOCK_TTL_S"
    assert read_flags([], {"SLOTKEEPER_LOCK_TTL_S": "2.5"}, (derived,), prog="x", description="") == {
        "lock_ttl_s": 2.5
    }
    assert FLAGS[0].env == "X_PORT"


def test_a_row_carries_its_default_and_its_check() -> None:
    @dataclass(frozen=True)
    class Settings:
        ttl: float
        name: str

    rows = (
        Flag("ttl", ("--ttl",), float, "ttl", default=15.0, check=(lambda v: v > 0, "> 0")),
        Flag("name", ("--name",), str, "a name"),
    )
    assert table_defaults(rows) == {"ttl": 15.0}
    check_settings(Settings(1.0, "a"), rows)
    with pytest.raises(SettingsError, match=r"--ttl must be > 0, got -1.0"):
        check_settings(Settings(-1.0, "a"), rows)

"""The shared flags table machinery."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from engine_pool.common import flags

TABLE = (
    flags.Flag("port", ("--port",), flags.parse_int, "port", required=True, variable="X_PORT"),
    flags.Flag("names", ("--name",), str, "repeatable", repeat=True, variable="X_NAMES"),
    flags.Flag("secret", (), str, "variable only", variable="X_SECRET"),
)


def read(argv: list[str], env: dict[str, str], table: tuple[flags.Flag, ...] = TABLE) -> dict[str, Any]:
    return flags.read_flags(argv, env, table, prog="x", description="")


SIZES = [("8Gi", 8 << 30), ("8GiB", 8 << 30), ("8G", 8 << 30), ("512K", 512 << 10), ("100", 100)]


@pytest.mark.parametrize("text, value", SIZES)
def test_byte_sizes(text: str, value: int) -> None:
    assert flags.parse_bytes(text) == value


def test_command_line_beats_environment_and_lists_repeat() -> None:
    env = {"X_PORT": "1", "X_NAMES": "a, b", "X_SECRET": "s"}
    got = read(["--port", "0x10"], env)
    assert got == {"port": 16, "names": ("a", "b"), "secret": "s"}
    assert read(["--port", "2", "--name", "c", "--name", "d"], {})["names"] == ("c", "d")


def test_errors_name_the_flag_or_variable() -> None:
    with pytest.raises(flags.SettingsError, match="--port is required"):
        read([], {})
    with pytest.raises(flags.SettingsError, match="X_PORT: invalid value"):
        read([], {"X_PORT": "nope"})
    with pytest.raises(flags.SettingsError, match="unrecognized arguments: --secret"):
        read(["--port", "1", "--secret", "s"], {})


def test_a_variable_is_derived_from_its_field_unless_declared() -> None:
    assert flags.env_name("lock_ttl_s") == "SLOTKEEPER_LOCK_TTL_S"
    derived = flags.Flag("lock_ttl_s", ("--lock-ttl-s",), float, "ttl", default=15.0)
    assert derived.env == "SLOTKEEPER_LOCK_TTL_S"
    assert read([], {"SLOTKEEPER_LOCK_TTL_S": "2.5"}, (derived,)) == {"lock_ttl_s": 2.5}
    assert TABLE[0].env == "X_PORT"


def test_a_row_carries_its_default_and_its_check() -> None:
    @dataclass(frozen=True)
    class Settings:
        ttl: float
        name: str

    rows = (
        flags.Flag("ttl", ("--ttl",), float, "ttl", default=15.0, check=(lambda v: v > 0, "> 0")),
        flags.Flag("name", ("--name",), str, "a name"),
    )
    assert flags.table_defaults(rows) == {"ttl": 15.0}
    flags.check_settings(Settings(1.0, "a"), rows)
    with pytest.raises(flags.SettingsError, match=r"--ttl must be > 0, got -1.0"):
        flags.check_settings(Settings(-1.0, "a"), rows)

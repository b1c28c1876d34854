"""The shared flags table machinery."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from engine_pool.process import flags

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


def test_a_variable_is_derived_from_its_first_long_flag_unless_declared() -> None:
    assert flags.env_name("lock_ttl_s") == "SLOTKEEPER_LOCK_TTL_S"
    derived = flags.Flag("lock_ttl_s", ("--lock-ttl-s",), float, "ttl", default=15.0)
    assert derived.env == "SLOTKEEPER_LOCK_TTL_S"
    assert read([], {"SLOTKEEPER_LOCK_TTL_S": "2.5"}, (derived,)) == {"lock_ttl_s": 2.5}
    assert TABLE[0].env == "X_PORT"
    # llama-server's names: the first long flag, not the field nor a later alias
    assert flags.int_flag("n_ctx", "-c --ctx-size --context", 1, "ctx").env == "SLOTKEEPER_CTX_SIZE"
    # a list is named after its field; a variable-only row too
    assert flags.list_flag("models", "-m --model", "models").env == "SLOTKEEPER_MODELS"
    assert flags.str_flag("internal_key", "", None, "key").env == "SLOTKEEPER_INTERNAL_KEY"
    assert flags.switch("verbose", "-v --log-verbose", "all", variable="SLOTKEEPER_VERBOSE").env == (
        "SLOTKEEPER_VERBOSE"
    )


def test_the_constructors_write_the_same_rows() -> None:
    port = flags.within(0, 65535)
    assert flags.int_flag("port", "-p --port", 80, "port", port) == flags.Flag(
        "port", ("-p", "--port"), flags.parse_int, "port", 80, port
    )
    assert flags.bytes_flag("size", "--size", 1 << 20, "size").parse is flags.parse_bytes
    assert flags.float_flag("ttl", "--ttl", 1.0, "ttl").parse is float
    assert flags.bool_flag("fa", "-fa", False, "on/off") == flags.Flag(
        "fa", ("-fa",), flags.parse_bool, "on/off", False
    )
    assert flags.str_flag("secret", "", None, "only a variable").flags == ()
    assert flags.flag("model", "-m", flags.NO_DEFAULT, "model", required=True).required
    on = flags.switch("metrics", "--metrics", "serve /metrics")
    assert (on.switch, on.default, on.parse) == (True, False, flags.parse_bool)
    many = flags.list_flag("names", "--name", "names")
    assert (many.repeat, many.default, read(["--name", "a", "--name", "b"], {}, (many,))) == (
        True,
        (),
        {"names": ("a", "b")},
    )


def test_one_of_names_the_choices_as_the_error_says_them() -> None:
    ok, what = flags.one_of("on", "off", "auto")
    assert (ok("off"), ok("maybe"), what) == (True, False, "on, off or auto")


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

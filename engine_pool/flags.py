"""Flags ↔ settings fields ↔ SLOTKEEPER_* variables: the declarative table every process uses.

Each process (engine, node, gateway) declares one `FLAGS` table of `Flag` rows and one frozen
settings dataclass; these functions are the only readers of such a table: the command line wins
over the environment, which wins over the dataclass default. Nothing else reads the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class SettingsError(ValueError):
    """A flag or SLOTKEEPER_* variable is unknown, missing or has a bad value."""


def parse_int(text: str) -> int:
    return int(text, 0)


def parse_bytes(text: str) -> int:
    """`1073741824`, `512K`, `64M`, `1G`, `8Gi`, `8GiB` (powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off", "auto", ""):
        return False
    raise ValueError(f"expected on/off, got {text!r}")


def parse_list(text: str) -> tuple[str, ...]:
    """A repeatable flag's variable: comma-separated."""
    return tuple(p for p in (s.strip() for s in text.split(",")) if p)


def parse_log_format(text: str) -> str:
    if text not in ("json", "console", "auto"):
        raise ValueError("expected json, console or auto")
    return text


@dataclass(frozen=True)
class Flag:
    """One row: settings field, its flags (none: variable only), its variable, parser, help line."""

    field: str
    flags: tuple[str, ...]
    env: str
    parse: Callable[[str], Any]
    help: str
    switch: bool = False  # a flag without a value (sets True); the variable still takes on/off
    repeat: bool = False  # may be given several times; the field is a tuple
    required: bool = False

    @property
    def name(self) -> str:
        return (self.flags or (self.env,))[-1]


Check = tuple[str, Callable[[Any], bool], str]  # field, predicate, what a valid value is

# Every command's --log-format (one row: each settings table holds it).
LOG_FORMAT = Flag(
    "log_format",
    ("--log-format",),
    "SLOTKEEPER_LOG_FORMAT",
    parse_log_format,
    "json, console, or auto: console on a terminal, else json (auto)",
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would print and exit; let the caller decide
        raise SettingsError(message)


def defaults_of(settings_class: Any) -> dict[str, Any]:
    """The field defaults of a settings dataclass, for `--help` to show."""
    return {
        f.name: f.default for f in dataclasses.fields(settings_class) if f.default is not dataclasses.MISSING
    }


def _with_default(text: str, default: Any) -> str:
    """`text` saying its default, unless it says it already or there is none to say."""
    if default in (None, "", ()) or isinstance(default, bool) or str(default) in text:
        return text
    return f"{text} (default {default})"


def add_flags(
    parser: Any,
    flags: Iterable[Flag],
    skip: Iterable[str] = (),
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """`flags` on `parser` (or an argument group of it); every help line names its variable and,
    from `defaults` (`defaults_of`), its default."""
    skipped = set(skip)
    for f in flags:
        if not f.flags or f.field in skipped:
            continue
        help_text = f"{_with_default(f.help, (defaults or {}).get(f.field))} [env {f.env}]"
        if f.switch:
            parser.add_argument(*f.flags, dest=f.field, action="store_const", const="on", help=help_text)
        elif f.repeat:
            parser.add_argument(
                *f.flags, dest=f.field, action="append", metavar=f.field.upper(), help=help_text
            )
        else:
            parser.add_argument(*f.flags, dest=f.field, metavar=f.field.upper(), help=help_text)


def build_parser(
    prog: str, description: str, flags: Iterable[Flag], defaults: Mapping[str, Any] | None = None
) -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description=description, allow_abbrev=False)
    add_flags(parser, flags, defaults=defaults)
    return parser


def values_from(args: Mapping[str, Any], flags: Iterable[Flag], environ: Mapping[str, str]) -> dict[str, Any]:
    """Parsed values of the flags given on the command line (`args`) or in the environment."""
    values: dict[str, Any] = {}
    for f in flags:
        raw: Any = args.get(f.field)
        source = f.name
        if raw is None and f.env in environ:
            raw, source = (parse_list(environ[f.env]) if f.repeat else environ[f.env]), f.env
        if raw is None:
            if f.required:
                raise SettingsError(f"{'/'.join(f.flags) or f.env} is required (or set {f.env})")
            continue
        try:
            values[f.field] = tuple(f.parse(r) for r in raw) if f.repeat else f.parse(raw)
        except ValueError as exc:
            raise SettingsError(f"{source}: invalid value {raw!r} ({exc})") from None
    return values


def read_flags(
    argv: Sequence[str],
    environ: Mapping[str, str],
    flags: Sequence[Flag],
    *,
    prog: str,
    description: str,
    defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    args = vars(build_parser(prog, description, flags, defaults).parse_args(list(argv)))
    return values_from(args, flags, environ)


def check(settings: Any, flags: Iterable[Flag], checks: Iterable[Check]) -> None:
    """Raise SettingsError naming the flag of the first field that fails its check."""
    by_field = {f.field: f for f in flags}
    for name, ok, what in checks:
        value = getattr(settings, name)
        if not ok(value):
            raise SettingsError(f"{by_field[name].name} must be {what}, got {value!r}")

"""Flags ↔ settings fields ↔ SLOTKEEPER_* variables: the declarative table every process uses.

Each process (engine, node, gateway) declares one `FLAGS` table of `Flag` rows and one frozen
settings dataclass whose defaults come from those rows (`table_defaults`). A row is the one source of
truth of its setting: flags, parser, help line, default and check; its variable is derived from its
first long flag (`--ctx-size` → SLOTKEEPER_CTX_SIZE), or from its field where it has none or repeats
(`--model` → SLOTKEEPER_MODELS, a list), unless the row declares another. The constructors (`flag`,
`int_flag`, `switch`, ...) write a row on a line. These functions are the only readers of such a
table: the command line wins over the environment, which wins over the default. Nothing else reads
the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar
from urllib.parse import urlsplit

ENV_PREFIX = "SLOTKEEPER_"


class _NoDefault:
    def __repr__(self) -> str:
        return "NO_DEFAULT"


NO_DEFAULT: Any = _NoDefault()  # a row whose field has no default (it must be given)


class SettingsError(ValueError):
    """A flag or SLOTKEEPER_* variable is unknown, missing or has a bad value."""


def env_name(field: str) -> str:
    """The variable of a settings field: `lock_ttl_s` → `SLOTKEEPER_LOCK_TTL_S`."""
    return ENV_PREFIX + field.upper()


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


Check = tuple[Callable[[Any], bool], str]  # predicate, what a valid value is


# The usual checks, each worded as the error message says it ("--port must be within 0..65535").
def at_least(low: float) -> Check:
    return (lambda v: v >= low, f">= {low}")


def above(low: float) -> Check:
    return (lambda v: v > low, f"> {low}")


def within(low: int, high: int) -> Check:
    return (lambda v: low <= v <= high, f"within {low}..{high}")


def one_of(*values: str) -> Check:
    """`one_of("on", "off", "auto")` → "on, off or auto"."""
    return (lambda v: v in values, f"{', '.join(values[:-1])} or {values[-1]}")


def url(*schemes: str, forms: str) -> Check:
    """A URL with one of `schemes` and a host (a path for `unix`), or none given; `forms` words the
    accepted forms for the error ("--redis-url must be redis://host:port/db, ..., got ...")."""

    def ok(value: Any) -> bool:
        if value is None:
            return True
        parts = urlsplit(str(value))
        return parts.scheme in schemes and bool(parts.path if parts.scheme == "unix" else parts.hostname)

    return (ok, forms)


S3_ENDPOINT = url("http", "https", forms="an http:// or https:// URL, e.g. http://minio.storage:9000")


@dataclass(frozen=True)
class Flag:
    """One setting: its field, flags (none: variable only), parser, help line, default and check.

    `variable` is declared only where the setting's variable is not the derived one (`env`)."""

    field: str
    flags: tuple[str, ...]
    parse: Callable[[str], Any]
    help: str
    default: Any = NO_DEFAULT
    check: Check | None = None  # checked on the built settings (`check_settings`)
    variable: str | None = None
    switch: bool = False  # a flag without a value (sets True); the variable still takes on/off
    repeat: bool = False  # may be given several times; the field is a tuple
    required: bool = False

    @property
    def env(self) -> str:
        """SLOTKEEPER_ + the first long flag (`-np/--parallel` → SLOTKEEPER_PARALLEL, llama-server's
        name); + the field for a variable-only row or a repeatable one (`--model` → SLOTKEEPER_MODELS:
        the variable holds the whole list)."""
        if self.variable:
            return self.variable
        long = [f for f in self.flags if f.startswith("--")]
        if self.repeat or not long:
            return env_name(self.field)
        return env_name(long[0].removeprefix("--").replace("-", "_"))

    @property
    def name(self) -> str:
        return (self.flags or (self.env,))[-1]

    def with_help(self, help: str) -> Flag:
        """The same setting (default, check, variable) described for another command's `--help`."""
        return dataclasses.replace(self, help=help)


def flag(
    field: str,
    flags: str,
    default: Any,
    help: str,
    check: Check | None = None,
    *,
    parse: Callable[[str], Any] = str,
    variable: str | None = None,
    required: bool = False,
) -> Flag:
    """A row on a line: `flags` space-separated ("-c --ctx-size"; "" for a variable-only setting)."""
    return Flag(field, tuple(flags.split()), parse, help, default, check, variable, required=required)


# The typed rows: `int_flag("port", "--port", 8080, "port (8080)", within(0, 65535))`.
str_flag = partial(flag, parse=str)
int_flag = partial(flag, parse=parse_int)
float_flag = partial(flag, parse=float)
bytes_flag = partial(flag, parse=parse_bytes)  # 512M, 1G, a number of bytes
bool_flag = partial(flag, parse=parse_bool)  # takes on/off: `-fa on`


def switch(field: str, flags: str, help: str, *, default: bool = False, variable: str | None = None) -> Flag:
    """A flag without a value, that sets True; its variable still takes on/off."""
    return Flag(field, tuple(flags.split()), parse_bool, help, default, variable=variable, switch=True)


def list_flag(field: str, flags: str, help: str, check: Check | None = None, *, default: Any = ()) -> Flag:
    """A repeatable flag: its field is a tuple, its variable comma-separated."""
    return Flag(field, tuple(flags.split()), str, help, default, check, repeat=True)


# Every command's --log-format and --log-level (one row each: every settings table holds them; a
# command may word the help line of --log-level its own way, `Flag.with_help`).
LOG_FORMAT = flag(
    "log_format",
    "--log-format",
    "auto",  # console on a terminal, JSON lines otherwise
    "json, console, or auto: console on a terminal, else json (auto)",
    parse=parse_log_format,
)
LOG_LEVEL = str_flag(
    "log_level",
    "--log-level",
    "info",
    "debug, info, warning, error",
    one_of("debug", "info", "warning", "error"),
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would print and exit; let the caller decide
        raise SettingsError(message)


def table_defaults(flags: Iterable[Flag]) -> dict[str, Any]:
    """Each row's default by field: what a settings dataclass takes its field defaults from."""
    return {f.field: f.default for f in flags if f.default is not NO_DEFAULT}


def _says_default(text: str, default: Any, parse: Callable[[str], Any]) -> bool:
    """Whether `text` states `default` already: a parenthesised value that reads as it (`(16M)` for
    16777216, `(60)` for 60.0, `(300; 0 = never)` for 300.0), or its own spelling in parentheses."""
    for said in re.findall(r"\(([^()]*)\)", text):
        first = re.split(r"[;,]", said, maxsplit=1)[0].strip()
        if first == str(default):
            return True
        try:
            if parse(first) == default:
                return True
        except (ValueError, TypeError):
            continue
    return False


def _with_default(text: str, default: Any, parse: Callable[[str], Any] = str) -> str:
    """`text` saying its default once: as it says it already, else with `(default X)` added; nothing
    when there is none to say."""
    if default in (None, "", ()) or isinstance(default, bool) or _says_default(text, default, parse):
        return text
    return f"{text} (default {default})"


def add_flags(parser: Any, flags: Iterable[Flag], skip: Iterable[str] = ()) -> None:
    """`flags` on `parser` (or an argument group of it); every help line names its variable and its
    row's default."""
    skipped = set(skip)
    for f in flags:
        if not f.flags or f.field in skipped:
            continue
        default = None if f.default is NO_DEFAULT else f.default
        help_text = f"{_with_default(f.help, default, f.parse)} [env {f.env}]"
        if f.switch:
            parser.add_argument(*f.flags, dest=f.field, action="store_const", const="on", help=help_text)
        elif f.repeat:
            parser.add_argument(
                *f.flags, dest=f.field, action="append", metavar=f.field.upper(), help=help_text
            )
        else:
            parser.add_argument(*f.flags, dest=f.field, metavar=f.field.upper(), help=help_text)


def build_parser(prog: str, description: str, flags: Iterable[Flag]) -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description=description, allow_abbrev=False)
    add_flags(parser, flags)
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
) -> dict[str, Any]:
    args = vars(build_parser(prog, description, flags).parse_args(list(argv)))
    return values_from(args, flags, environ)


S = TypeVar("S")


def settings_or_status(
    command: str, argv: Sequence[str], parse: Callable[[], S], parser: Callable[[], argparse.ArgumentParser]
) -> S | int:
    """The settings `slotkeeper {command}` runs with, or its exit status when there are none: 0 after
    printing the help (`-h`, `--help`), 2 after saying what is wrong with the flags on stderr."""
    if any(a in ("-h", "--help") for a in argv):
        parser().print_help()
        return 0
    try:
        return parse()
    except SettingsError as exc:
        print(f"slotkeeper {command}: error: {exc}\n(see `slotkeeper {command} --help`)", file=sys.stderr)
        return 2


def check_settings(settings: Any, flags: Iterable[Flag]) -> None:
    """Raise SettingsError naming the flag of the first row (in table order) whose field fails its check."""
    for f in flags:
        if f.check is None:
            continue
        ok, what = f.check
        value = getattr(settings, f.field)
        if not ok(value):
            raise SettingsError(f"{f.name} must be {what}, got {value!r}")

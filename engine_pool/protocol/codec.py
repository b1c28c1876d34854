"""One codec for the typed payloads that cross a process boundary: frozen dataclasses ⇄ JSON objects.

A payload is a frozen dataclass whose fields are JSON-shaped: `str`, `int`, `float`, `bool`, another
payload, `list[...]` / `tuple[..., ...]` of those, `dict[str, ...]`, or any of them `| None`. It
inherits `Wire`, which gives it `to_json`, `from_json` and `from_body`, all written once here:

- `encode` writes each field under its name (tuples as arrays, nested payloads as objects). A
  payload with `sparse = True` (a request) leaves out every field at its default, and an empty
  array whose default is None, so an older reader reads a newer writer's common requests.
- `decode` reads a JSON object into the payload and validates as it goes, every complaint naming
  the field by its path (`copies[2].bytes`): JSON `null` counts as absent; an absent field takes
  its default, or None when its type admits None, and is otherwise required (all required fields
  are checked before any type); integers are never booleans (a float with no fraction is an
  integer); `wire(lo=, hi=)` bounds a number, `wire(max_items=)` an array, `wire(absent=)` says
  what an absent field without a default reads as, and `wire(parse=)` hands a field's value to a
  function of its own (which raises `WireError`, or `BadRequest` in a field only requests have).
- Failures are `WireError` (a ValueError with `.field`): `from_body` turns one into the caller's
  400 (`BadRequest`, param = the field); `from_json` lets it rise, for the reader of another
  service's answer to treat as a broken peer (as a KeyError or ValueError was before).

Unknown keys are ignored, as the API conventions of this project expect.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Self, TypeVar, Union

from engine_pool.errors import BadRequest
from engine_pool.http.body import Body, json_type

T = TypeVar("T")
Parse = Callable[[Any, str], Any]  # (a present, non-null value, its field path) -> the field's value

_META = "wire"
_MISSING: Any = dataclasses.MISSING
_UNSET: Any = object()  # `wire(absent=)` not given


class WireError(ValueError):
    """A JSON object that is not the payload it should be; `field` is the path of the offender."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


@dataclasses.dataclass(frozen=True)
class FieldRule:
    """What `wire(...)` adds to a field beyond its type (see the module doc)."""

    lo: float | None = None
    hi: float | None = None
    max_items: int | None = None
    absent: Any = _UNSET
    parse: Parse | None = None


def wire(**rule: Any) -> dict[str, FieldRule]:
    """Field metadata for `dataclasses.field(metadata=wire(...))`."""
    return {_META: FieldRule(**rule)}


def one_of(choices: tuple[str, ...]) -> Parse:
    """A `wire(parse=)` for a string field that takes one of ``choices``."""

    def parse(value: Any, where: str) -> str:
        if value not in choices:
            raise WireError(f"'{where}' must be one of {', '.join(choices)}", where)
        return str(value)

    return parse


class Wire:
    """The codec's methods on a payload class; `sparse`: leave fields at their defaults out."""

    sparse: ClassVar[bool] = False

    def to_json(self) -> dict[str, Any]:
        return encode(self)

    @classmethod
    def from_json(cls, data: Any) -> Self:
        """Another service's answer as this payload (a `WireError` when it is not one)."""
        return decode(cls, data)

    @classmethod
    def from_body(cls, body: Body) -> Self:
        """A request body as this payload, or a 400 naming the field."""
        try:
            return decode(cls, body.data, body.path)
        except WireError as err:
            raise BadRequest(err.message, param=err.field) from None


# -- encoding -----------------------------------------------------------------------------------------
def encode(obj: Any) -> dict[str, Any]:
    """A payload as its JSON object (see the module doc)."""
    sparse = getattr(obj, "sparse", False)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if sparse and _at_default(f, value):
            continue
        out[f.name] = _encode_value(value)
    return out


def _at_default(f: dataclasses.Field[Any], value: Any) -> bool:
    if f.default is not _MISSING:
        default = f.default
    elif callable(f.default_factory):
        default = f.default_factory()
    else:
        return False  # required: always written
    if value == default:
        return True
    return default is None and isinstance(value, list | tuple | dict) and not value


def _encode_value(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return encode(value)
    if isinstance(value, list | tuple):
        return [_encode_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode_value(v) for k, v in value.items()}
    return value


# -- decoding -----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    kind: Any  # the resolved annotation
    default: Any  # what an absent field reads as; _MISSING when it is required
    factory: Callable[[], Any] | None  # or what makes it (a dataclass default_factory)
    rule: FieldRule


_SCHEMAS: dict[type, tuple[_Field, ...]] = {}  # each payload class's fields, read once


def _fields(cls: type) -> tuple[_Field, ...]:
    if cls not in _SCHEMAS:
        _SCHEMAS[cls] = _read_fields(cls)
    return _SCHEMAS[cls]


def _read_fields(cls: type) -> tuple[_Field, ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        rule = f.metadata.get(_META, FieldRule())
        factory = f.default_factory if callable(f.default_factory) else None
        if f.default is not _MISSING:
            default: Any = f.default
        elif factory is not None:
            default = None
        elif rule.absent is not _UNSET:
            default = rule.absent
        elif _admits_none(kind):
            default = None
        else:
            default = _MISSING
        out.append(_Field(f.name, kind, default, factory, rule))
    return tuple(out)


def _admits_none(kind: Any) -> bool:
    return _is_union(kind) and type(None) in typing.get_args(kind)


def _is_union(kind: Any) -> bool:
    return typing.get_origin(kind) in (Union, types.UnionType)


def _path(base: str, name: str) -> str:
    return f"{base}.{name}" if base else name


def decode(cls: type[T], data: Any, path: str = "") -> T:
    """`data` as a `cls` payload, validated (see the module doc); `path` names where it lies."""
    if not isinstance(data, Mapping):
        raise WireError(f"'{path or 'the body'}' must be an object, got {json_type(data)}", path)
    fields = _fields(cls)
    for f in fields:  # every required field first, then the types: a missing one is named first
        if f.default is _MISSING and data.get(f.name) is None:
            where = _path(path, f.name)
            raise WireError(f"'{where}' is required", where)
    values = {}
    for f in fields:
        raw = data.get(f.name)
        if raw is None:
            values[f.name] = f.factory() if f.factory is not None else f.default
            continue
        where = _path(path, f.name)
        values[f.name] = f.rule.parse(raw, where) if f.rule.parse else _value(f.kind, raw, where, f.rule)
    return cls(**values)


def _value(kind: Any, raw: Any, where: str, rule: FieldRule) -> Any:
    if _is_union(kind):
        inner = [k for k in typing.get_args(kind) if k is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"{where}: the codec reads unions with None only, not {kind}")
        kind = inner[0]
    origin = typing.get_origin(kind)
    if origin in (list, tuple):
        if not isinstance(raw, list):
            raise _bad(where, "an array", raw)
        if rule.max_items is not None and len(raw) > rule.max_items:
            raise WireError(f"'{where}' holds {len(raw)} items, more than {rule.max_items}", where)
        item = typing.get_args(kind)[0]
        items = [_value(item, v, f"{where}[{i}]", FieldRule()) for i, v in enumerate(raw)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(raw, dict):
            raise _bad(where, "an object", raw)
        item = typing.get_args(kind)[1]
        return {k: _value(item, v, _path(where, k), FieldRule()) for k, v in raw.items()}
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return decode(kind, raw, where)
    return _scalar(kind, raw, where, rule)


def _scalar(kind: Any, raw: Any, where: str, rule: FieldRule) -> Any:
    if kind is bool:
        if not isinstance(raw, bool):
            raise _bad(where, "a boolean", raw)
        return raw
    if kind is str:
        if not isinstance(raw, str):
            raise _bad(where, "a string", raw)
        return raw
    if kind is int:
        if isinstance(raw, float) and raw.is_integer():
            raw = int(raw)
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise _bad(where, "an integer", raw)
        return _in_range(raw, where, rule)
    if kind is float:
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise _bad(where, "a number", raw)
        return float(_in_range(raw, where, rule))
    if kind is Any:
        return raw
    raise TypeError(f"{where}: the codec has no rule for {kind}")


def _in_range(value: float, where: str, rule: FieldRule) -> Any:
    lo, hi = rule.lo, rule.hi
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = (
            f"within {lo}..{hi}"
            if lo is not None and hi is not None
            else (f">= {lo}" if lo is not None else f"<= {hi}")
        )
        raise WireError(f"'{where}' must be {bounds}, got {value}", where)
    return value


def _bad(where: str, what: str, value: Any) -> WireError:
    return WireError(f"'{where}' must be {what}, got {json_type(value)}", where)

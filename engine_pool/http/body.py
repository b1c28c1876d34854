"""Request bodies: JSON parsing and typed field access whose every complaint names the field.

A field sent as JSON `null` counts as absent (OpenAI clients send nulls for unset options). Unknown
fields are ignored, as llama-server and the OpenAI conventions expect. Booleans are never accepted
where a number is expected, even though Python's bool is an int.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request

from engine_pool.errors import BadRequest, PayloadTooLarge, RequestTimeout
from engine_pool.process.limit_flags import BODY_TIMEOUT_S, MAX_BODY_BYTES, MAX_JSON_DEPTH

T = TypeVar("T")

_JSON_TYPE = {
    dict: "object",
    list: "array",
    str: "string",
    bool: "boolean",
    int: "integer",
    float: "number",
    type(None): "null",
}


def json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for messages."""
    return _JSON_TYPE.get(type(value), type(value).__name__)


@dataclass(frozen=True)
class BodyLimits:
    """Bounds on one request body, each refused with a precise 4xx before the body is used.

    `max_bytes` (413) is checked against Content-Length before anything is read and again while
    reading, so a lying or missing header cannot get more in; `read_timeout_s` (408) bounds how long
    a client may trickle its body; `max_depth` (400) bounds JSON nesting, which would otherwise reach
    Python's recursion limit (a 500) or make every later walk over the body expensive.
    """

    max_bytes: int = MAX_BODY_BYTES.default
    max_depth: int = MAX_JSON_DEPTH.default
    read_timeout_s: float = BODY_TIMEOUT_S.default


DEFAULT_LIMITS = BodyLimits()


async def read_body(request: Request, limits: BodyLimits = DEFAULT_LIMITS) -> bytes:
    """The raw body within `limits` (413 when larger, 408 when it does not arrive in time).

    A body over the limit is still read to its end (within the read timeout) and thrown away, never
    kept: answering while the client is still sending makes the closing socket reset the connection,
    and the client would see a connection error instead of the 413.
    """
    declared = request.headers.get("content-length")
    if declared is not None and not declared.isdigit():
        raise BadRequest("Content-Length must be a non-negative integer")
    too_large = declared is not None and int(declared) > limits.max_bytes
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(limits.read_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                too_large = too_large or size > limits.max_bytes
                if not too_large:
                    chunks.append(chunk)
    except TimeoutError:
        if not too_large:
            raise RequestTimeout(
                f"the request body did not arrive within {limits.read_timeout_s:g} s"
            ) from None
    if too_large:
        raise PayloadTooLarge(
            f"the request body has {max(size, int(declared or 0))} bytes or more; "
            f"the limit is {limits.max_bytes}",
            extra={"limit": limits.max_bytes},
        )
    return b"".join(chunks)


def json_depth_exceeds(value: Any, max_depth: int) -> bool:
    """True when arrays/objects nest deeper than `max_depth` (iterative: no recursion to exhaust)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} is beyond the range of a double")
    return value


# Where a decoded string can hold a lone UTF-16 surrogate: a `\uD800`-`\uDFFF` escape, or those code
# points written as (invalid) UTF-8, which Python's decoder lets through. Bodies without either are
# not walked.
_SURROGATE_HINT = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_at(value: Any) -> str | None:
    """The path of the first string (or key) in `value` holding a lone surrogate, else None."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path or "the body"
        elif isinstance(item, dict):
            children = []
            for k, v in item.items():
                shown = _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", k)  # (the answer is UTF-8)
                where = f"{path}.{shown}" if path else shown
                if shown != k:
                    return where
                children.append((v, where))
            stack.extend(reversed(children))  # (first in document order first)
        elif isinstance(item, list):
            stack.extend(reversed([(v, f"{path}[{i}]") for i, v in enumerate(item)]))
    return None


def parse_json_object(raw: bytes, limits: BodyLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """`raw` as a JSON object within `limits.max_depth`, or BadRequest saying precisely what is wrong.

    Stricter than Python's parser, as llama-server's is: NaN and Infinity are no JSON, a number
    beyond a double's range is refused, and so is text holding a lone UTF-16 surrogate, which is no
    Unicode (nothing downstream could encode it: a tokenizer, a digest, a UTF-8 writer).
    """
    if not raw.strip():
        raise BadRequest("the request body is empty; expected a JSON object")
    try:
        data = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    except UnicodeDecodeError:
        raise BadRequest("the request body is not valid UTF-8") from None
    except ValueError as exc:  # the hooks above, or an integer past Python's digit limit
        why = str(exc)
        if "integer string conversion" in why:
            why = f"an integer has more than {sys.get_int_max_str_digits()} digits"
        raise BadRequest(f"the request body is not valid JSON: {why}") from None
    except RecursionError:
        data = None  # deeper than the interpreter can parse: certainly deeper than the limit
    if data is None or json_depth_exceeds(data, limits.max_depth):
        raise BadRequest(f"the request body nests JSON deeper than {limits.max_depth} levels")
    if not isinstance(data, dict):
        raise BadRequest(f"the request body must be a JSON object, got {json_type(data)}")
    if _SURROGATE_HINT.search(raw) or json.detect_encoding(raw) != "utf-8":
        where = lone_surrogate_at(data)
        if where is not None:
            raise BadRequest(
                f"'{where}' holds a lone UTF-16 surrogate, which is not Unicode text", param=where
            )
    return data


async def read_json(request: Request, limits: BodyLimits = DEFAULT_LIMITS) -> Body:
    """The request's JSON object within `limits`, or a precise 4xx (400, 408, 413)."""
    return Body(parse_json_object(await read_body(request, limits), limits))


class Body:
    """Typed, validated access to one JSON object (a request body or an object inside it)."""

    def __init__(self, data: dict[str, Any], path: str = "") -> None:
        self.data = data
        self.path = path

    def name(self, field: str) -> str:
        return f"{self.path}.{field}" if self.path else field

    def has(self, field: str) -> bool:
        return self.data.get(field) is not None

    def raw(self, field: str, default: Any = None) -> Any:
        value = self.data.get(field)
        return default if value is None else value

    def _bad(self, field: str, what: str, value: Any) -> BadRequest:
        return BadRequest(
            f"'{self.name(field)}' must be {what}, got {json_type(value)}", param=self.name(field)
        )

    def get_int(self, field: str, default: int, *, lo: int | None = None, hi: int | None = None) -> int:
        value = self.data.get(field)
        if value is None:
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(field, "an integer", value)
        self._check_range(field, value, lo, hi)
        return value

    def get_float(
        self, field: str, default: float, *, lo: float | None = None, hi: float | None = None
    ) -> float:
        value = self.data.get(field)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._bad(field, "a number", value)
        self._check_range(field, value, lo, hi)
        return float(value)

    def _check_range(self, field: str, value: float, lo: float | None, hi: float | None) -> None:
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            bounds = (
                f"within {lo}..{hi}"
                if lo is not None and hi is not None
                else (f">= {lo}" if lo is not None else f"<= {hi}")
            )
            raise BadRequest(f"'{self.name(field)}' must be {bounds}, got {value}", param=self.name(field))

    def _typed(self, field: str, kind: type[T], what: str) -> T | None:
        """The field's value (None when absent or null), refused unless it is a `kind`."""
        value = self.data.get(field)
        if value is None or isinstance(value, kind):
            return value
        raise self._bad(field, what, value)

    def get_bool(self, field: str, default: bool) -> bool:
        value = self._typed(field, bool, "a boolean")
        return default if value is None else value

    def get_str(self, field: str, default: str | None = None) -> str | None:
        value = self._typed(field, str, "a string")
        return default if value is None else value

    def get_choice(self, field: str, default: str, choices: Sequence[str]) -> str:
        value = self.get_str(field, default)
        assert value is not None
        if value not in choices:
            raise BadRequest(
                f"'{self.name(field)}' must be one of {', '.join(choices)}; got {value!r}",
                param=self.name(field),
            )
        return value

    def get_list(self, field: str) -> list[Any] | None:
        return self._typed(field, list, "an array")

    def get_object(self, field: str) -> Body | None:
        value = self._typed(field, dict, "an object")
        return None if value is None else Body(value, self.name(field))

    def objects(self, field: str) -> Iterator[Body]:
        """Each entry of the array `field` (none when absent) as a Body named `field[i]`, in order; an
        entry that is not an object is refused when the iteration reaches it."""
        for i, value in enumerate(self.get_list(field) or []):
            where = f"{self.name(field)}[{i}]"
            if not isinstance(value, dict):
                raise BadRequest(f"'{where}' must be an object, got {json_type(value)}", param=where)
            yield Body(value, where)

    def get_str_list(self, field: str) -> list[str]:
        """A string or an array of strings (OpenAI's `stop`)."""
        value = self.data.get(field)
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        raise self._bad(field, "a string or an array of strings", value)

    def get_token_list(self, field: str, n_vocab: int) -> list[int] | None:
        value = self.get_list(field)
        if value is None:
            return None
        return check_tokens(value, n_vocab, self.name(field))


def check_tokens(value: list[Any], n_vocab: int, name: str) -> list[int]:
    """Token ids inside the vocabulary, or BadRequest naming the first offender."""
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int):
            raise BadRequest(f"'{name}[{i}]' must be a token id (integer), got {json_type(t)}", param=name)
        if not 0 <= t < n_vocab:
            raise BadRequest(f"'{name}[{i}]' = {t} is outside the vocabulary (0..{n_vocab - 1})", param=name)
    return list(value)

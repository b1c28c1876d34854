"""Request bodies: JSON parsing and typed field access whose every complaint names the field.

A field sent as JSON `null` counts as absent (OpenAI clients send nulls for unset options). Unknown
fields are ignored, as llama-server and the OpenAI conventions expect. Booleans are never accepted
where a number is expected, even though Python's bool is an int.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from starlette.requests import Request

from .errors import BadRequest

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


async def read_json(request: Request) -> Body:
    """The request's JSON object, or BadRequest saying precisely what is wrong with it."""
    raw = await request.body()
    if not raw.strip():
        raise BadRequest("the request body is empty; expected a JSON object")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    except UnicodeDecodeError:
        raise BadRequest("the request body is not valid UTF-8") from None
    if not isinstance(data, dict):
        raise BadRequest(f"the request body must be a JSON object, got {json_type(data)}")
    return Body(data)


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

    def get_bool(self, field: str, default: bool) -> bool:
        value = self.data.get(field)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._bad(field, "a boolean", value)
        return value

    def get_str(self, field: str, default: str | None = None) -> str | None:
        value = self.data.get(field)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self._bad(field, "a string", value)
        return value

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
        value = self.data.get(field)
        if value is None:
            return None
        if not isinstance(value, list):
            raise self._bad(field, "an array", value)
        return value

    def get_object(self, field: str) -> Body | None:
        value = self.data.get(field)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self._bad(field, "an object", value)
        return Body(value, self.name(field))

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

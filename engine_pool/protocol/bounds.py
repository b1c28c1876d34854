"""The 400 for a client-controlled list or string past its bound, or for a string-or-array field
that is neither, in one wording for every parser.

The engine's request checks (`engine_pool.server.limits`) and the Responses and Messages translations
— which the gateway runs too — refuse an oversized field alike: the message names the field, what it
holds and the limit, and `extra.limit` carries the limit for programs. Pure.
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

from engine_pool.errors import BadRequest
from engine_pool.http.body import json_type


def too_many(field: str, n: int, limit: int, what: str) -> BadRequest:
    """`'field' has n what; the limit is limit` as a 400."""
    return BadRequest(
        f"'{field}' has {n} {what}; this engine accepts at most {limit}",
        param=field,
        extra={"limit": limit},
    )


def check_count(field: str, items: Sized, limit: int, what: str = "entries") -> None:
    """Refuse `items` when it holds more than `limit` entries."""
    if len(items) > limit:
        raise too_many(field, len(items), limit, what)


def array_form(value: Any, field: str, limit: int, items: str, counted: str = "") -> list[Any]:
    """`value`, the array form of a field that is a string or an array of `items` (the caller took
    the string), refused when it is not an array or holds more than `limit` entries (`counted`: what
    they are called in that message; `items` when left out)."""
    if not isinstance(value, list):
        raise BadRequest(
            f"'{field}' must be a string or an array of {items}, got {json_type(value)}", param=field
        )
    check_count(field, value, limit, counted or items)
    return value

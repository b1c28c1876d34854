"""The 400 for a client-controlled list or string past its bound, in one wording for every parser.

The engine's request checks (`engine_pool.server.limits`) and the Responses and Messages translations
— which the gateway runs too — refuse an oversized field alike: the message names the field, what it
holds and the limit, and `extra.limit` carries the limit for programs. Pure.
"""

from __future__ import annotations

from collections.abc import Sized

from ..common.errors import BadRequest


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

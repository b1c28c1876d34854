"""Another service's HTTP answer read back: its JSON, and the `{"error": {...}}` object in it.

The reading side of `engine_pool.errors.error_payload`, for the callers of an engine, a node
agent or a gateway. Neither function raises on a body that is not what it should be: the caller
falls back to the status and the raw text.
"""

from __future__ import annotations

from typing import Any

import httpx


def answer_json(r: httpx.Response) -> Any:
    """The answer's JSON, or None when its body is not JSON."""
    try:
        return r.json()
    except ValueError:
        return None


def error_object(body: Any) -> dict[str, Any] | None:
    """The `error` object of an `{"error": {...}}` body; None when the body has none."""
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else None

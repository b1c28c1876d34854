"""A node agent's calls to its engines' slot actions (llama-server's `POST /slots/{id}?action=`).

One call is one action — save, restore, erase or cancel, named by the answer it expects
(:mod:`engine_pool.protocol.slot_actions`). The engine's own errors keep their status, type and
message; an answer that is not what the action answers is a 502.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from engine_pool.errors import ApiError, Upstream
from engine_pool.http.answers import answer_json, error_object

from ..protocol.codec import WireError
from ..protocol.slot_actions import SlotAnswer
from .supervisor import EngineSupervisor

SLOT_TIMEOUT = httpx.Timeout(600.0, connect=5.0)  # a save waits for the slot's running request


@dataclass(frozen=True)
class SlotCaller:
    """Slot actions over the node's HTTP client; a 503's Retry-After is ``retry_after_s``."""

    http: httpx.AsyncClient
    retry_after_s: float

    async def __call__(
        self,
        sup: EngineSupervisor,
        slot: int,
        answer: type[SlotAnswer],
        filename: str | None = None,
        label: Mapping[str, Any] | None = None,
    ) -> SlotAnswer:
        """One slot action, named by its ``answer`` (``label``: the slot label a save expects, or a
        restore gives, and a save's `durable`)."""
        engine_id, action = sup.spec.engine_id, answer.action
        try:
            r = await self.http.post(
                f"{sup.url}/slots/{slot}",
                params={"action": action},
                json={"filename": filename, **(label or {})} if filename else None,
                timeout=SLOT_TIMEOUT,
            )
        except httpx.HTTPError as exc:
            raise Upstream(f"engine {engine_id}: slot {action} failed: {type(exc).__name__}: {exc}") from exc
        body = answer_json(r)
        if r.status_code == 200 and isinstance(body, dict):
            try:
                return answer.from_json(body)
            except WireError as exc:
                raise Upstream(f"engine {engine_id}: slot {action} answered {exc}") from exc
        error = error_object(body)
        if error is None:
            error = {"message": r.text[:500]}
        status = r.status_code if r.status_code < 500 or r.status_code == 503 else 502
        extra = {k: v for k, v in error.items() if k not in ("message", "type", "param", "code")}
        code = error.get("code")
        raise ApiError(
            f"engine {engine_id}: {error.get('message')}",
            status=status,
            extra=extra,
            type=str(error.get("type") or ("upstream_error" if status == 502 else "invalid_request_error")),
            code=code if isinstance(code, str) else None,
            retry_after=self.retry_after_s if status == 503 else None,
        )

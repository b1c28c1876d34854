"""Which session a turn runs on: the one the request names, the one its history finds, or a new one."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

from gateway.tenants import Tenant
from gateway.turn.parts import TurnParts
from gateway.turn.prompt import Prompt, system_digest
from gateway.turn.signals import session_key


async def resolve(
    parts: TurnParts,
    tenant: Tenant,
    headers: Mapping[str, str],
    body: Mapping[str, Any],
    prompt: Prompt | None,
) -> tuple[str, str]:
    """The session a request names (gateway.turn.signals), finds implicitly by the digests of its
    history (gateway.turn.prompt: `Prompt.lookup`), or a new one; and how it was found. Whether
    the turn continues that session or branches from it is decided once its record is read
    (gateway.turn.branch)."""
    messages = body.get("messages")

    def scope() -> str | None:  # an agent's conversations: one session per system prompt
        return system_digest(messages) if isinstance(messages, list) else None

    explicit, source = session_key(headers, body, scope)
    if explicit is not None:
        return explicit, source
    if prompt is not None:
        hit = await find_conversation(parts, tenant.name, prompt)
        if hit is not None:
            return hit[1], "implicit"
    return "s-" + secrets.token_hex(12), "new"


async def find_conversation(parts: TurnParts, tenant: str, prompt: Prompt) -> tuple[str, str] | None:
    """The session that recorded the longest part of the prompt's conversation, and the digest it
    was found by (one of `Prompt.lookup`: a complete turn, or a head); None when none did. The
    routes of the turns this process just answered are written first (`Holds.routed`)."""
    if not prompt.lookup:
        return None
    await parts.holds.routed(tenant, prompt.lookup, parts.settings.spill_wait_s)
    return await parts.index.match_prefix(tenant, prompt.lookup)

"""Which session a turn runs on: the one the request names, the one its history finds, or a new one."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

from gateway.prefixes import lookup_digests, system_digest
from gateway.session_keys import session_key
from gateway.tenants import Tenant
from storage.index.session_index import SessionIndex


async def resolve(
    index: SessionIndex, tenant: Tenant, headers: Mapping[str, str], body: Mapping[str, Any], model: str
) -> tuple[str, str]:
    """The session a request names (gateway.session_keys), finds implicitly by the digests of its
    history (gateway.prefixes), or a new one; and how it was found."""
    messages = body.get("messages")

    def scope() -> str | None:  # an agent's conversations: one session per system prompt
        return system_digest(messages) if isinstance(messages, list) else None

    explicit, source = session_key(headers, body, scope)
    if explicit is not None:
        return explicit, source
    if isinstance(messages, list):
        hit = await index.match_prefix(tenant.name, lookup_digests(messages, model))
        if hit is not None:
            return hit[1], "implicit"
    return "s-" + secrets.token_hex(12), "new"

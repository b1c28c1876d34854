"""Implicit session routing: digests of canonical message prefixes.

An agent that resends its history should land on its session without sending any id. After each
turn the gateway records the digest of every history prefix that ends with an assistant message
(a complete turn); a new request is looked up by the digests of its own prefixes, longest first.
Prefixes that end elsewhere (the shared system prompt, a first user message) are never recorded, so
two conversations that merely start alike stay apart.

Canonical form: role, the text of the content (string or text parts joined), tool calls as
(name, arguments parsed as JSON when possible), tool_call_id and name; whitespace and key order in
the JSON encoding are fixed, so an SDK's serialisation choices do not matter.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") in ("text", "input_text", "output_text"):
                parts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    return str(content)


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def canonical_message(message: Mapping[str, Any]) -> str:
    """One message in the fixed JSON form that the digests are computed over."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", {}) if isinstance(call, Mapping) else {}
        calls.append([fn.get("name", ""), _arguments(fn.get("arguments", ""))])
    canon = {
        "role": message.get("role", ""),
        "content": _content_text(message.get("content")),
        "tool_calls": calls,
        "tool_call_id": message.get("tool_call_id") or "",
        "name": message.get("name") or "",
    }
    return json.dumps(canon, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def prefix_digests(messages: Sequence[Mapping[str, Any]], model: str) -> list[str]:
    """Digest of messages[0..i] for every i (chained SHA-256, scoped by the model)."""
    out = []
    h = hashlib.sha256(model.encode())
    for message in messages:
        h.update(b"\x1e" + canonical_message(message).encode())
        out.append(h.copy().hexdigest()[:32])
    return out


def turn_digests(messages: Sequence[Mapping[str, Any]], model: str) -> list[str]:
    """The digests worth recording for a history: prefixes that end with an assistant message."""
    digests = prefix_digests(messages, model)
    return [d for d, m in zip(digests, messages, strict=True) if m.get("role") == "assistant"]


def lookup_digests(messages: Sequence[Mapping[str, Any]], model: str) -> list[str]:
    """The digests to look a request up by, longest prefix first (only complete turns count)."""
    return list(reversed(turn_digests(messages, model)))

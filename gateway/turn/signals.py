"""Which session a request names: our header and the session signals agents send.

First match wins, in the order of `SIGNALS`:

| signal | sent by | session id |
|---|---|---|
| `X-Session-Id` header | any client (ours) | the value itself (a valid id, else 400) |
| `x-claude-code-session-id` header | Claude Code | `cc-` + digest |
| `thread-id` header | Codex CLI | `cx-` + digest |
| `client_metadata.thread_id` body field | Codex CLI (Responses) | `cx-` + digest |
| `session_id` / `session-id` header | Codex CLI | `cx-` + digest |
| `client_metadata.session_id` body field | Codex CLI (Responses) | `cx-` + digest |
| `prompt_cache_key` body field | Codex, OpenCode, OpenAI SDK users | `pck-` + digest |

Without any, the session is found implicitly (gateway.turn.prompt) or is new.

Codex names one conversation a thread and a run of the CLI a session: the same id while the
conversation is the CLI's only one, several threads (sub-agents) in one session otherwise. So the
thread id, the narrower, comes first. Codex's signals digest under one name (`family`), so that its
header and its `client_metadata` with the same value give the same session — and the one its
`session-id` header alone gave before the thread was read.

An agent sends its signal on every request of a working session, also on the requests that are
not its conversation: a title, a summary, a sub-agent with its own system prompt. Served as one
session, each would throw the conversation's state out of its slot. So the signals agents send
(not `X-Session-Id`, which names exactly one session) are scoped by the request's system prompt
(`gateway.turn.prompt.system_digest`): the digest covers the value and that prompt, and each of an
agent's conversations gets its own session. Session ids, like every
key, are scoped to the tenant by the index. Values are bounded (`MAX_SIGNAL_CHARS`, printable
ASCII) and refused precisely otherwise.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from engine_pool.errors import BadRequest
from storage.errors import InvalidId
from storage.ids import validate_id

MAX_SIGNAL_CHARS = 256


@dataclass(frozen=True)
class Signal:
    name: str  # a header name (lower case), a body field, or a field of the body's client_metadata
    where: Literal["header", "body", "client_metadata"]
    label: str  # as errors name it
    source: str  # how the session was found, in logs and `Turn.source`
    id_prefix: str  # "": the value is the session id itself
    family: str = ""  # the name the digest is taken under ("": `name`)


SIGNALS: tuple[Signal, ...] = (
    Signal("x-session-id", "header", "X-Session-Id", "header", ""),
    Signal("x-claude-code-session-id", "header", "x-claude-code-session-id", "claude-code", "cc-"),
    Signal("thread-id", "header", "thread-id", "codex", "cx-", "session-id"),
    Signal("thread_id", "client_metadata", "client_metadata.thread_id", "codex", "cx-", "session-id"),
    Signal("session_id", "header", "session_id", "codex", "cx-"),
    Signal("session-id", "header", "session-id", "codex", "cx-"),
    Signal("session_id", "client_metadata", "client_metadata.session_id", "codex", "cx-", "session-id"),
    Signal("prompt_cache_key", "body", "prompt_cache_key", "prompt_cache_key", "pck-"),
)


def _raw(signal: Signal, headers: Mapping[str, str], body: Mapping[str, Any]) -> Any:
    if signal.where == "header":
        return headers.get(signal.name)
    if signal.where == "body":
        return body.get(signal.name)
    meta = body.get("client_metadata")  # (the Responses parser checked it; others send none)
    return meta.get(signal.name) if isinstance(meta, Mapping) else None


def _value(signal: Signal, raw: Any) -> str:
    label = signal.label
    if not isinstance(raw, str) or not raw.strip():
        raise BadRequest(f"{label} must be a non-empty string", param=label)
    value = raw.strip()
    if len(value) > MAX_SIGNAL_CHARS:
        raise BadRequest(
            f"{label} is {len(value)} characters long; the limit is {MAX_SIGNAL_CHARS}", param=label
        )
    if not value.isascii() or not value.isprintable():
        raise BadRequest(f"{label} must be printable ASCII", param=label)
    if not signal.id_prefix:
        try:
            return validate_id(value, label)
        except InvalidId as exc:
            raise BadRequest(str(exc), param=label) from None
    return value


def session_key(
    headers: Mapping[str, str], body: Mapping[str, Any], scope: Callable[[], str | None]
) -> tuple[str | None, str]:
    """(session id, source) of the first signal the request carries, or (None, "implicit").
    `scope()` is the digest of the request's system prompt (asked only for an agent's signal)."""
    for signal in SIGNALS:
        raw = _raw(signal, headers, body)
        if raw is None:
            continue
        value = _value(signal, raw)
        if not signal.id_prefix:
            return value, signal.source
        family = signal.family or signal.name
        digest = hashlib.sha256(f"{family}\x1e{value}\x1e{scope() or ''}".encode()).hexdigest()[:40]
        return signal.id_prefix + digest, signal.source
    return None, "implicit"

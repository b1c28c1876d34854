"""Digests of canonical message prefixes: implicit session routing and shared prefixes.

An agent that resends its history should land on its session without sending any id. After each
turn the gateway records the digest of every history prefix that ends with an assistant message
(a complete turn); a new request is looked up by the digests of its own prefixes, longest first.
Prefixes that end elsewhere (the shared system prompt, a first user message) never route, so two
conversations that merely start alike stay apart. A whole prompt sent again (`prompt_digest`) does
not route either: it starts a new session from the state of the one that served it.

What such conversations do share is their *shared prefix*: the tools and the leading system (or
developer) messages, the same for every session an agent starts. Its digest (`shared_digest`)
finds a session of the tenant that holds the prefix's state (storage.index.shared_prefixes); the system
messages' alone (`system_digest`) scope the session ids agents send (gateway.turn.signals).

Canonical form: role, the text of the content (string or text parts joined), tool calls as
(name, arguments parsed as JSON when possible), tool_call_id and name; whitespace and key order in
the JSON encoding are fixed, so an SDK's serialisation choices do not matter.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from storage.index.records import SessionRecord


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


def _listed(value: Any) -> list[Any]:
    """An array field as a list ([] for anything else: the engine refuses such a request precisely,
    after routing, which reads it first)."""
    return value if isinstance(value, list) else []


def _utf8(text: str) -> bytes:
    """`text` as UTF-8, lone surrogates included (a `\\ud800` escape is valid JSON): the digests are
    total over whatever a body decodes to."""
    return text.encode("utf-8", "surrogatepass")


def canonical_message(message: Mapping[str, Any]) -> str:
    """One message in the fixed JSON form that the digests are computed over."""
    calls = []
    for call in _listed(message.get("tool_calls")):
        fn = call.get("function", {}) if isinstance(call, Mapping) else {}
        if not isinstance(fn, Mapping):
            fn = {}
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
        h.update(b"\x1e" + _utf8(canonical_message(message)))
        out.append(h.copy().hexdigest()[:32])
    return out


# The tokens a chat template wraps one message in (role markers, a tool result's tags), or the
# generation prompt, at most.
TEMPLATE_TOKENS = 16


def tokens_at_most(messages: Sequence[Mapping[str, Any]]) -> int:
    """How many prompt tokens ``messages`` render to, at most, whatever the tokenizer: a text token
    covers at least one byte of the text it renders; a template adds `TEMPLATE_TOKENS` around each
    message and for the generation prompt, and may write a call's JSON arguments anew with a space
    after each separator (at most twice their bytes)."""
    total = TEMPLATE_TOKENS
    for m in messages:
        total += TEMPLATE_TOKENS + len(_utf8(_content_text(m.get("content"))))
        total += len(_utf8(_content_text(m.get("reasoning_content"))))  # templates may render it
        total += len(_utf8(str(m.get("name") or ""))) + len(_utf8(str(m.get("tool_call_id") or "")))
        for call in _listed(m.get("tool_calls")):
            fn = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(fn, Mapping):
                arguments = fn.get("arguments", "")
                text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
                total += TEMPLATE_TOKENS + len(_utf8(str(fn.get("name", "")))) + 2 * len(_utf8(text))
    return total


def turn_digests(messages: Sequence[Mapping[str, Any]], model: str) -> list[str]:
    """The digests worth recording for a history: prefixes that end with an assistant message."""
    digests = prefix_digests(messages, model)
    return [d for d, m in zip(digests, messages, strict=True) if m.get("role") == "assistant"]


def prompt_digest(messages_digest: str, tools: Any) -> str:
    """Digest of a whole prompt: its messages (`prefix_digests`' last, which the model scopes) and
    its tools as sent. A new session whose prompt has this digest starts from the state of the
    session that last served it (`storage.index.shared_prefixes`): a prompt sent again without a
    session id costs what it costs with one."""
    h = hashlib.sha256(b"prompt\x1e" + messages_digest.encode())
    h.update(b"\x1e" + _utf8(json.dumps(tools or [], separators=(",", ":"), ensure_ascii=False)))
    return h.hexdigest()[:32]


def finished_digests(
    messages: Sequence[Mapping[str, Any]], reply: Mapping[str, Any], tools: Any, model: str
) -> tuple[list[str], str | None]:
    """A finished turn's digests, in one pass over its history: those its next turn is routed by
    (`turn_digests` of the messages and the reply) and its prompt's (`prompt_digest`; None
    without messages)."""
    history = [*messages, reply]
    chain = prefix_digests(history, model)
    turns = [d for d, m in zip(chain, history, strict=True) if m.get("role") == "assistant"]
    return turns, prompt_digest(chain[-2], tools) if messages else None


def lookup_digests(messages: Sequence[Mapping[str, Any]], model: str) -> list[str]:
    """The digests to look a request up by, longest prefix first (only complete turns count)."""
    return list(reversed(turn_digests(messages, model)))


def tools_digest(tools: Any) -> str:
    """Digest of the tools as sent, in their order (templates render them so), hashed once per
    request: every head of the request names them by it."""
    return hashlib.sha256(
        _utf8(json.dumps(tools or [], separators=(",", ":"), ensure_ascii=False))
    ).hexdigest()


def head_digest(messages_digest: str, tools: str) -> str:
    """Digest of a conversation as one turn's prompt: its messages (a `prefix_digests` entry) and
    its tools (`tools_digest`). A session records the head of its last turn: its state is that
    prompt and the reply (gateway.turn.branch)."""
    return hashlib.sha256(f"head\x1e{messages_digest}\x1e{tools}".encode()).hexdigest()[:32]


def continued_heads(chain: Sequence[str], messages: Sequence[Mapping[str, Any]], tools: str) -> list[str]:
    """The heads a request goes on from, longest first: for each assistant message (a reply, whatever
    its text: templates render it again, clients send it back in their own form), the head of the
    messages before it. ``chain``: the messages' `prefix_digests`."""
    return [
        head_digest(chain[i - 1], tools)
        for i in range(len(messages) - 1, 0, -1)
        if messages[i].get("role") == "assistant"
    ]


def route_lookup(chain: Sequence[str], messages: Sequence[Mapping[str, Any]], tools: str) -> list[str]:
    """What implicit routing looks a request up by, longest first: for each assistant message, the
    complete turn up to it (its route, reply included), then the head before it (the same
    conversation, found whatever form the reply came back in)."""
    out = []
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "assistant":
            out.append(chain[i])
            if i:
                out.append(head_digest(chain[i - 1], tools))
    return out


def _leading_system(messages: Sequence[Mapping[str, Any]]) -> Sequence[Mapping[str, Any]]:
    n = 0
    while n < len(messages) and messages[n].get("role") in ("system", "developer"):
        n += 1
    return messages[:n]


def _system_hash(messages: Sequence[Mapping[str, Any]], seed: bytes) -> Any:
    h = hashlib.sha256(seed)
    for message in messages:  # role and text: the canonical JSON would cost a pass more
        h.update(
            b"\x1e" + _utf8(str(message.get("role"))) + b"\x1f" + _utf8(_content_text(message.get("content")))
        )
    return h


def system_digest(messages: Sequence[Mapping[str, Any]]) -> str | None:
    """Digest of the leading system/developer messages (None without any): what scopes the
    session ids agents send (gateway.turn.signals), on every turn of theirs, so it is cheap."""
    system = _leading_system(messages)
    return _system_hash(system, b"system").hexdigest()[:32] if system else None


def shared_digest(messages: Sequence[Mapping[str, Any]], tools: Any, model: str) -> str | None:
    """Digest of the tools and the leading system/developer messages (scoped by the model), or
    None when there are neither. The tools as sent, in their order (templates render them so:
    tools in another key order render other tokens)."""
    system = _leading_system(messages)
    if not system and not tools:
        return None
    h = _system_hash(system, b"shared\x1e" + model.encode())
    h.update(b"\x1e" + _utf8(json.dumps(tools or [], separators=(",", ":"), ensure_ascii=False)))
    return h.hexdigest()[:32]


# What the gateway sets in an engine body (never the tenant's: gateway.turn.serving), and the tenant's
# own session key: a tokenization for the prompt sends none of them.
GATEWAY_FIELDS = frozenset(
    {"prompt_cache_key", "id_slot", "prefix_slots", "slot_owner", "slot_session", "slot_expect", "slotkeeper"}
)


class Prompt:
    """The prompt a turn is placed for, and its digests (this module), computed once as the turn
    starts: its chain of prefix digests, what implicit routing looks it up by (`lookup`), the heads
    it goes on from (`heads`: whether it continues a session or branches from it,
    gateway.turn.branch), its complete turns (`turns`), its own head (recorded when it finishes).
    Only its shared prefix's digest waits until a placement asks for it. A conversation that
    leaves the stored one before its end (an edited earlier message, a retry from far back) needs
    only the stored part up to the checkpoint the engine continues from, and the node can cut the
    generation there given the prompt's tokens — which the placing step asks the engine for
    (`tokens_body`: what it sends)."""

    def __init__(
        self, messages: Sequence[Mapping[str, Any]], model: str, body: Mapping[str, Any], tools: Any = None
    ) -> None:
        self.messages, self.model, self.body, self.tools = messages, model, body, tools
        self.chain = prefix_digests(messages, model)
        self.tools_key = tools_digest(tools)
        self.lookup = route_lookup(self.chain, messages, self.tools_key)
        self.heads = frozenset(continued_heads(self.chain, messages, self.tools_key))
        self.turns = frozenset(
            d for d, m in zip(self.chain, messages, strict=True) if m.get("role") == "assistant"
        )
        self.head = head_digest(self.chain[-1], self.tools_key) if messages else None

    def added_at_most(self, head: str) -> int | None:
        """The prompt tokens this prompt adds to the state of a session whose last turn had ``head``
        (its prompt and reply), at most: 0 for that prompt again; None when it does not go on from
        there. A bound, before any tokenizer: `tokens_at_most` of the messages after that reply."""
        if head == self.head:
            return 0
        for i in range(len(self.messages) - 1, 0, -1):
            reply = self.messages[i].get("role") == "assistant"
            if reply and head_digest(self.chain[i - 1], self.tools_key) == head:
                return tokens_at_most(self.messages[i + 1 :])
        return None

    @functools.cached_property
    def shared(self) -> str | None:
        """The digest of its shared prefix (gateway.turn.prompt), computed once, only when needed: a
        warm turn does not hash its tools and system prompt again."""
        return shared_digest(self.messages, self.tools, self.model)

    def tokens_body(self) -> dict[str, Any]:
        """The chat body to ask an engine for the prompt's tokens with: the tenant's fields only."""
        upstream = {k: v for k, v in self.body.items() if k not in GATEWAY_FIELDS}
        upstream.update(model=self.model, cache_prompt=True)
        return upstream

    def sources(self) -> list[str]:
        """The digests a session without state of its own may start from, best first: this very
        prompt's (sent again), then its shared prefix's (gateway.turn.prompt)."""
        whole = self.chain[-1:]
        return [d for d in (*(prompt_digest(w, self.tools) for w in whole), self.shared) if d]

    def leaves(self, record: SessionRecord) -> bool:
        """Whether the prompt leaves the stored conversation before its end: its complete turns do
        not include the conversation the session was saved at (its routing digest). A prompt that
        goes on from there gets the whole generation, without asking for tokens."""
        return bool(record.route) and record.route not in self.turns

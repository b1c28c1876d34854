"""A turn of a session as the gateway carries it: what it was placed for, where it runs, what it holds.

Plain data, handed from one step of the turn to the next (gateway.turns runs the steps): the
`RestorePrompt` a turn is placed for, the `Turn` it becomes once placed, and the settings every
step reads (`TurnSettings`, built once per process).
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine_pool.pool.client import NodeClient
from gateway.holds import SessionHold
from gateway.placement import Placement
from gateway.prefixes import (
    continued_heads,
    head_digest,
    prefix_digests,
    prompt_digest,
    route_lookup,
    shared_digest,
    tools_digest,
)
from gateway.tenants import Tenant
from storage.ids import validate_id
from storage.index.locks import SessionLock
from storage.index.records import SessionRecord

CHAT_PATH = "/v1/chat/completions"  # the engine's chat completions path

# What the gateway sets in an engine body (never the tenant's: gateway.turn_path), and the tenant's
# own session key: a tokenization for the prompt sends none of them.
GATEWAY_FIELDS = frozenset(
    {"prompt_cache_key", "id_slot", "prefix_slots", "slot_owner", "slot_session", "slot_expect", "slotkeeper"}
)


@dataclass(frozen=True)
class TurnSettings:
    """What the steps of a turn read of the gateway's settings (gateway.settings), built once."""

    lock_ttl_s: float
    spill_wait_s: float  # the longest a turn waits for a lock held by a save, a delete, an eviction
    save_grace_s: float = 0.0
    early_start: bool = True  # launch a held session's turn beside its opening read (gateway.early)
    internal_key: str | None = None  # what the node agents require
    keep_generations: int = 2  # stored generations a session keeps (the newest)
    max_inflight: int = 64  # a tenant's in-flight places unless its quota says
    inflight_ttl_s: float = 660.0  # a place lapses after this (its gateway died)


@dataclass(frozen=True)
class RestorePrompt:
    """The prompt a turn is placed for, and its digests (gateway.prefixes), each computed once,
    when first needed: what implicit routing looks it up by (`lookup`), the heads it goes on from
    (`heads`: whether it continues a session or branches from it, gateway.branches), its own head
    (recorded when it finishes). A conversation that leaves the stored one before its end (an edited
    earlier message, a retry from far back) needs only the stored part up to the checkpoint the
    engine continues from, and the node can cut the generation there given the prompt's tokens —
    which the placing step asks the engine for (`tokens_body`: what it sends)."""

    messages: Sequence[Mapping[str, Any]]
    model: str
    body: Mapping[str, Any]  # the chat body as the tenant sent it (after its volatile-block rules)
    tools: Any = None  # as sent

    @functools.cached_property
    def chain(self) -> list[str]:
        """The digests of its message prefixes (gateway.prefixes.prefix_digests)."""
        return prefix_digests(self.messages, self.model)

    @functools.cached_property
    def tools_key(self) -> str:
        return tools_digest(self.tools)

    @functools.cached_property
    def lookup(self) -> list[str]:
        """What implicit routing looks it up by, longest first (gateway.prefixes.route_lookup)."""
        return route_lookup(self.chain, self.messages, self.tools_key)

    @functools.cached_property
    def heads(self) -> frozenset[str]:
        """The heads it goes on from (gateway.prefixes.continued_heads)."""
        return frozenset(continued_heads(self.chain, self.messages, self.tools_key))

    @functools.cached_property
    def turns(self) -> frozenset[str]:
        """The digests of its complete turns (gateway.prefixes.turn_digests)."""
        return frozenset(
            d for d, m in zip(self.chain, self.messages, strict=True) if m.get("role") == "assistant"
        )

    @functools.cached_property
    def head(self) -> str | None:
        """Its own head: what the session records once it answered (None without messages)."""
        return head_digest(self.chain[-1], self.tools_key) if self.messages else None

    @functools.cached_property
    def shared(self) -> str | None:
        """The digest of its shared prefix (gateway.prefixes), computed once, only when needed: a
        warm turn does not hash its tools and system prompt again."""
        return shared_digest(self.messages, self.tools, self.model)

    def tokens_body(self) -> dict[str, Any]:
        """The chat body to ask an engine for the prompt's tokens with: the tenant's fields only."""
        upstream = {k: v for k, v in self.body.items() if k not in GATEWAY_FIELDS}
        upstream.update(model=self.model, cache_prompt=True)
        return upstream

    def sources(self) -> list[str]:
        """The digests a session without state of its own may start from, best first: this very
        prompt's (sent again), then its shared prefix's (gateway.prefixes)."""
        whole = self.chain[-1:]
        return [d for d in (*(prompt_digest(w, self.tools) for w in whole), self.shared) if d]

    def leaves(self, record: SessionRecord) -> bool:
        """Whether the prompt leaves the stored conversation before its end: its complete turns do
        not include the conversation the session was saved at (its routing digest). A prompt that
        goes on from there gets the whole generation, without asking for tokens."""
        return bool(record.route) and record.route not in self.turns


@dataclass
class Turn:
    """A placed turn: what answering it and finishing it need (gateway.turn_path, gateway.bookkeeping)."""

    tenant: Tenant
    session: str
    model: str
    hold: SessionHold  # the session's lock, shared with this turn's write-behind save
    placement: Placement
    engine_url: str
    node: NodeClient
    source: str  # how the session was found (gateway.session_keys), or implicit | new | fork
    forked_from: str | None = None
    inflight: str = ""  # the tenant's in-flight place this turn holds (given back when it finishes)
    settled: bool = False  # its bookkeeping was started (`TurnRunner.finish_soon`)
    early: bool = False  # the call launched before its opening read is this turn's (confirmed)
    shared: str | None = None  # its shared prefix's digest, to record for other sessions (or None)
    prompt: RestorePrompt | None = None  # what it was placed for (its tools name its prompt's digest)
    created: bool = False  # its session's record was created for it (a new session, a branch, a fork)

    @property
    def lock(self) -> SessionLock:
        return self.hold.lock


def fork_id(session: str) -> str:
    """A fresh id for a fork of `session`: valid whatever the parent's id ends with, at most 128
    characters (a parent like `dot2.` would otherwise give `dot2..fXXXX`, which ids refuse)."""
    base = session[:110].rstrip(".") or "s"
    return validate_id(f"{base}.f{secrets.token_hex(4)}", "fork id")

"""The prefill/decode split, defined once for every end: engine roles, the handoff's request to the
node agent and its result.

A `prefill` engine only evaluates prompts for others; a `decode` engine holds sessions and
generates; a `mixed` engine (the default) does both. A handoff (gateway.turn.handoff decides,
engine_pool.pool.handoff carries it out) evaluates a turn's prompt on a prefill engine, exports the
slot's state (attention KV, recurrent state, the checkpoint ladder and the last logits) as a slot
file, and installs it in the decode engine's slot, which then samples the first token from the
handed logits: 0 prompt tokens evaluated there. `last-token` is the comparison design most
systems use: the prefill stops one token early and the decode side evaluates the last one.

A turn of a session whose state is in the decode slot already (live there, or restored there for
the turn) is split with `carry`: that state goes to the prefill slot first (saved, linked,
restored), the prefill engine evaluates only the new tail, and the result comes back as above.

A prefill engine on another node (`prefill_node`: that node agent's URL) is reached node to node:
the decode engine's node sends it a `PREFILL` request — a frame (`HANDOFF_MEDIA`: one line of
compact JSON, the `HandoffRequest`, then a carried state's slot file, if any) — and reads back a
frame of the same form: one line of JSON (`Prefilled`), then the exported slot file. When the two
nodes cannot reach each other (the decode engine's node answers `peer_unreachable`), the gateway
goes through the store: it asks the prefill engine's node to export into a transient object
(`to_store`, a `handoff_key`; the answer is `Prefilled` alone) and the decode engine's node to
install from it (`from_store`), and deletes the object.

Pure: no I/O here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from engine_pool.http.body import json_type

from .codec import Wire, WireError, one_of, wire

# A node-to-node prefill's request and answer: one line of compact JSON, then a slot file's bytes.
HANDOFF_MEDIA = "application/x-slotkeeper-handoff"
PREFILL = "/v1/engines/{engine}/prefill"  # on the prefill engine's node
MAX_FRAME_HEAD = 1 << 28  # the JSON line's bytes at most (a turn's chat body, past any body limit)
_NODE_URL = re.compile(r"https?://[^\s/?#@]+(/[^\s?#]*)?")
_HANDOFF_KEY = re.compile(r"\.handoffs/[0-9a-f]{32}\.slot")  # (under the store's prefix)


def prefill_path(engine: str) -> str:
    return PREFILL.format(engine=engine)


def handoff_key(token: str) -> str:
    """The store key (under the store's prefix) of a handoff's state going through the store; a
    folder no tenant can be named after (tenant ids never start with a dot)."""
    return f".handoffs/{token}.slot"


def stored_at(prefix: str, key: str) -> str:
    """A `handoff_key` as a store with ``prefix`` names its object."""
    return f"{prefix}/{key}" if prefix else key


class Role(StrEnum):
    PREFILL = "prefill"  # evaluates prompts for decode engines; holds no session
    DECODE = "decode"  # holds sessions; long uncached prompts are prefilled elsewhere
    MIXED = "mixed"  # both (the default): every engine before the split existed


ROLES = tuple(r.value for r in Role)


def holds_sessions(role: str) -> bool:
    """Whether turns are placed on an engine of this role (an unknown role, from a newer node: yes)."""
    return role != Role.PREFILL


class HandoffMode(StrEnum):
    LOGITS = "logits"  # the whole prompt, and its last logits: the decode side evaluates 0 tokens
    LAST_TOKEN = "last-token"  # all but the last token: the decode side evaluates 1 (the N-1 design)


HANDOFF_MODES = tuple(m.value for m in HandoffMode)


def parse_threshold(text: str) -> int | None:
    """A handoff threshold as a flag or a tenants file writes it: a number of uncached prompt tokens
    (0: every turn is split), or `off` (None: none is)."""
    if text.strip().lower() == "off":
        return None
    return int(text)


class HandoffOutcome(StrEnum):
    """`slotkeeper_*_handoffs_total{result}`: how a handoff ended."""

    DONE = "done"  # installed in the decode slot
    REFUSED = "refused"  # the decode engine refused the state (another model or format, damaged)
    UNAVAILABLE = "unavailable"  # no prefill engine, or it was busy past its bound
    FAILED = "failed"  # the prefill engine failed, or the node did
    CANCELLED = "cancelled"  # the caller left during it (the client did): cancelled where it ran


HANDOFF_OUTCOMES = tuple(o.value for o in HandoffOutcome)


def _chat_body(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise WireError(f"'{where}' must be an object, got {json_type(value)}", where)
    return value


def _node_url(value: Any, where: str) -> str:
    """A node agent's http(s) URL, or '' (this node)."""
    if value == "":
        return value
    if not isinstance(value, str) or len(value) > 2048 or not _NODE_URL.fullmatch(value):
        raise WireError(f"'{where}' must be a node agent's http(s) URL", where)
    return value


def _store_key(value: Any, where: str) -> str:
    """A `handoff_key`, or '' (none)."""
    if value == "":
        return value
    if not isinstance(value, str) or not _HANDOFF_KEY.fullmatch(value):
        raise WireError(f"'{where}' must be a handoff's store key (.handoffs/<32 hex>.slot)", where)
    return value


@dataclass(frozen=True)
class HandoffRequest(Wire):
    """Prefill ``body`` (the engine's chat completions body, as the turn would send it) on
    ``prefill_engine`` of the same node, and install the state in this slot labelled (tenant,
    session). ``wait_s``: the longest the prefill may wait for a free prefill slot (then 503);
    ``timeout_s``: the longest the prefill itself may take (then it is cancelled there, 503).
    ``carry``: this slot holds the session's state (labelled so): it is carried to the prefill slot
    first, which then evaluates only the prompt's new tail. ``prefill_node``: the URL of the node
    agent that runs ``prefill_engine`` when it is not this one (node to node); ``model``: the model
    the prefill engine must serve (set in a node-to-node request: the peer knows no decode engine);
    ``carry_from``: the session the slot's state is labelled with when not this one (a fork's or a
    branch's parent, restored there for this turn). Through the store: ``to_store`` (to the prefill
    engine's node) exports the state into that object instead of answering it; ``from_store`` (to
    the decode engine's node) installs the state from that object instead of prefilling."""

    sparse = True

    tenant: str
    session: str
    prefill_engine: str
    body: dict[str, Any] = field(metadata=wire(parse=_chat_body))
    mode: str = field(default=HandoffMode.LOGITS.value, metadata=wire(parse=one_of(HANDOFF_MODES)))
    wait_s: float = field(default=2.0, metadata=wire(lo=0, hi=600))
    timeout_s: float = field(default=600.0, metadata=wire(lo=0.001, hi=3600))
    carry: bool = False
    prefill_node: str = field(default="", metadata=wire(parse=_node_url))
    model: str = ""
    carry_from: str = ""
    to_store: str = field(default="", metadata=wire(parse=_store_key))
    from_store: str = field(default="", metadata=wire(parse=_store_key))


@dataclass(frozen=True)
class Prefilled(Wire):
    """A prompt prefilled on a lent slot of a prefill engine and exported as a slot file of
    ``bytes`` bytes (its frame's rest); ``carried_bytes``: the carried state restored there first,
    in ``carry_ms``."""

    prefill_slot: int
    prompt_n: int
    bytes: int
    checkpoints: int
    prefill_ms: float
    export_ms: float
    carried_bytes: int = 0
    carry_ms: float = 0.0


@dataclass(frozen=True)
class HandoffResult(Wire):
    """A handoff done: the prompt tokens the prefill engine evaluated, the state's tokens and bytes,
    and where the time went (carry: a carried state's way to the prefill slot, prefill, export: the
    slot file written, install: restored there)."""

    prefill_engine: str
    prefill_slot: int
    tokens: int
    prompt_n: int
    bytes: int
    checkpoints: int
    mode: str
    prefill_ms: float
    export_ms: float
    install_ms: float
    ms: float
    carried_bytes: int = 0  # the session's state carried to the prefill slot (`carry`), else 0
    carry_ms: float = 0.0
    prefill_node: str = ""  # the node agent the prefill ran on, when not the decode engine's
    through_store: bool = False  # its state went through the store (the nodes could not meet)

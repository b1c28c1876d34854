"""The node agent's API: its paths and each request and result, defined once for both ends.

Every request and result is a frozen dataclass with the one codec (`engine_pool.protocol.codec`):
the agent's routes (`engine_pool.pool.routes`) parse requests with `from_body` and answer with `to_json`;
its client (`engine_pool.pool.client`) sends `to_json` and reads answers with `from_json`. Errors are
not modelled here: they travel as the common `{"error": {...}}` body (`engine_pool.errors`).

Invariants: `to_json` writes exactly the keys the other end reads; requests are sparse (optional
fields left out at their defaults, so an older agent reads a newer client's common requests);
`from_body` refuses a malformed request with a 400 naming the field; `from_json` checks an answer's
types too and raises `WireError` on one that is not what it should be (a broken node, not the
caller's fault). A result's JSON is its fields, each under its name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine_pool.errors import BadRequest
from engine_pool.http.body import check_tokens, json_type

from .codec import Wire, one_of, wire

HEALTH = "/health"
ENGINES = "/v1/engines"
METRICS = "/metrics"
SLOT_OPERATION = "/v1/engines/{engine}/slots/{slot}/{op}"
SESSION = "/v1/sessions/{tenant}/{session}"
UNSTORED = "/v1/unstored"  # the spill cache's files the store does not hold yet
SLOT_OPS = ("spill", "fill", "erase", "cancel", "handoff")
MAX_FILL_TOKENS = 1 << 21  # a fill's prompt tokens (a context of 2M tokens)


def slot_path(engine: str, slot: int, op: str) -> str:
    return SLOT_OPERATION.format(engine=engine, slot=slot, op=op)


def session_path(tenant: str, session: str) -> str:
    return SESSION.format(tenant=tenant, session=session)


def _prompt_tokens(value: Any, where: str) -> list[int]:
    """A fill's `tokens`: an array of at most `MAX_FILL_TOKENS` ids, each a non-negative 32-bit
    integer."""
    if not isinstance(value, list):
        raise BadRequest(f"'{where}' must be an array, got {json_type(value)}", param=where)
    if len(value) > MAX_FILL_TOKENS:
        raise BadRequest(f"'{where}' holds {len(value)} ids, more than {MAX_FILL_TOKENS}", param=where)
    return check_tokens(value, 1 << 31, where)  # the node does not know the vocabulary: any i32 id


# -- requests -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpillRequest(Wire):
    """Save a slot as (tenant, session, generation) and upload it. `route`: the session's newest
    routing digest, kept with the object for reindexing (its format is the store's, checked by the
    agent); `share`: its stored chunks may be shared with the tenant's other sessions; `fenced`:
    the slot must hold the session (its label says so), else nothing is saved (409 slot_changed)."""

    sparse = True

    tenant: str
    session: str
    generation: int = field(metadata=wire(lo=1))
    route: str = ""
    share: bool = True
    fenced: bool = False


@dataclass(frozen=True)
class FillRequest(Wire):
    """Restore (tenant, session, generation) into a slot. `tokens`: the prompt it is restored for
    (a prompt leaving the generation early gets the part up to its checkpoint); `prefix`: the
    generation is another session's, restored only when the prompt shares enough of it;
    `progress`: answer with `FillProgress` reports as the fill goes (`FILL_LINES`)."""

    sparse = True

    tenant: str
    session: str
    generation: int = field(metadata=wire(lo=1))
    tokens: list[int] | None = field(default=None, metadata=wire(parse=_prompt_tokens))
    prefix: bool = False
    progress: bool = False


# -- results --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpillResult(Wire):
    """Where the spilled generation went: `uploaded` False leaves it in the node's spill cache,
    unconfirmed, for the flush loop; `written` is what the upload added to the store (0 while pending)."""

    tenant: str
    session: str
    generation: int
    key: str
    bytes: int
    tokens: int
    uploaded: bool
    ms: float
    written: int = 0


# A fill asked with `progress` is answered 200 with one JSON object a line: `{"progress":
# FillProgress}` as the fill goes, then `{"result": FillResult}` — or, where it failed, `{"status":
# <the HTTP status it would have answered>, "error": {...}}` (the common error body; `retry_after`
# in seconds beside them where it has one). A fill that ends before its first report is answered as
# one that reports nothing: an error then (a malformed body, an unknown engine) is an ordinary one.
FILL_LINES = "application/x-ndjson"
FILL_STAGES = ("fetching", "restoring")


@dataclass(frozen=True)
class FillProgress(Wire):
    """How far a fill has come: its `stage` — "fetching" the generation from the store (`bytes` of
    its `total` in so far), "restoring" it into the slot (the engine loads the file) — and the
    milliseconds since the fill began. `total`: the stored generation's size (0: not known)."""

    stage: str = field(metadata=wire(parse=one_of(FILL_STAGES)))
    bytes: int = field(metadata=wire(lo=0))
    total: int = field(metadata=wire(lo=0))
    ms: float = field(metadata=wire(lo=0))


@dataclass(frozen=True)
class FillResult(Wire):
    """What was restored: `source` "local" (spill cache), "store", "cut" (the store's pieces up to
    a checkpoint) or "none" (a prefix the prompt does not share: the slot left as it was)."""

    tokens: int
    bytes: int
    source: str
    ms: float


@dataclass(frozen=True)
class EraseResult(Wire):
    n_erased: int  # tokens the slot held


@dataclass(frozen=True)
class CancelResult(Wire):
    cancelled: bool  # False when no generation ran on the slot


SlotResult = SpillResult | FillResult | EraseResult | CancelResult


@dataclass(frozen=True)
class ForgetResult(Wire):
    """The session's spill-cache files the node dropped (pending uploads included)."""

    tenant: str
    session: str
    n_files: int


@dataclass(frozen=True)
class UnstoredCopy(Wire):
    """A generation only this node's spill cache holds (its upload not confirmed yet: the store
    was away, or it is being uploaded now). What a lost index is rebuilt from beside the store."""

    tenant: str
    session: str
    generation: int
    key: str  # the blob key it will be stored under
    bytes: int
    tokens: int
    model: str  # the model fingerprint the slot file names
    saved_at: float  # unix time the file was saved


@dataclass(frozen=True)
class UnstoredList(Wire):
    node: str = field(metadata=wire(absent=""))  # (absent from an older agent's answer)
    copies: tuple[UnstoredCopy, ...]


@dataclass(frozen=True)
class NodeHealth(Wire):
    """`status` "ok", or "draining" (answered with 503: a load balancer stops sending work)."""

    status: str
    node: str = field(metadata=wire(absent=""))


@dataclass(frozen=True)
class NodeEngine(Wire):
    """One supervised engine as `GET /v1/engines` lists it."""

    id: str
    model: str
    url: str | None
    state: str
    n_slots: int
    restarts: int
    pid: int | None
    instance: str = ""  # the current process's instance id (new at every start)
    error: str = ""  # one line: why it last failed (state "failed": why it was given up)
    last_error: str = ""  # why it last crashed, with the end of its log
    role: str = "mixed"  # prefill | decode | mixed (engine_pool.protocol.handoff)


@dataclass(frozen=True)
class EngineList(Wire):
    node: str = field(metadata=wire(absent=""))
    engines: tuple[NodeEngine, ...]

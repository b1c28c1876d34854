"""The node agent's API: its paths and each request and result, defined once for both ends.

The agent (`engine_pool.pool.agent`) parses requests with `from_body` and answers with `to_json`;
its client (`engine_pool.pool.client`) sends `to_json` and reads answers with `from_json`. Errors are
not modelled here: they travel as the common `{"error": {...}}` body (`engine_pool.common.errors`).

Invariants: `to_json` writes exactly the keys the other end reads, with optional request fields
left out at their defaults (so an older agent reads a newer client's common requests); `from_json`
trusts the agent's answer (the node is an internal service behind the internal key) and converts no
more than the types; `from_body` refuses a malformed request with a 400 naming the field. Plain
frozen dataclasses: a result's JSON is its fields, each under its name; the rest is converted by
hand, with no validation layer on the hot path.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..common.body import Body, check_tokens
from ..common.errors import BadRequest

HEALTH = "/health"
ENGINES = "/v1/engines"
METRICS = "/metrics"
SLOT_OPERATION = "/v1/engines/{engine}/slots/{slot}/{op}"
SESSION = "/v1/sessions/{tenant}/{session}"
UNSTORED = "/v1/unstored"  # the spill cache's files the store does not hold yet
SLOT_OPS = ("spill", "fill", "erase", "cancel")
MAX_FILL_TOKENS = 1 << 21  # a fill's prompt tokens (a context of 2M tokens)


def slot_path(engine: str, slot: int, op: str) -> str:
    return SLOT_OPERATION.format(engine=engine, slot=slot, op=op)


def session_path(tenant: str, session: str) -> str:
    return SESSION.format(tenant=tenant, session=session)


def _generation(body: Body) -> tuple[str, str, int]:
    """The (tenant, session, generation) every spill and fill names; each is required."""
    for field in ("tenant", "session", "generation"):
        if not body.has(field):
            raise BadRequest(f"'{field}' is required", param=field)
    return str(body.get_str("tenant")), str(body.get_str("session")), body.get_int("generation", 0, lo=1)


# -- requests -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpillRequest:
    """Save a slot as (tenant, session, generation) and upload it. `route`: the session's newest
    routing digest, kept with the object for reindexing (its format is the store's, checked by the
    agent); `share`: its stored chunks may be shared with the tenant's other sessions; `fenced`:
    the slot must hold the session (its label says so), else nothing is saved (409 slot_changed)."""

    tenant: str
    session: str
    generation: int
    route: str = ""
    share: bool = True
    fenced: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tenant": self.tenant, "session": self.session, "generation": self.generation}
        if self.route:
            out["route"] = self.route
        if not self.share:
            out["share"] = False
        if self.fenced:
            out["fenced"] = True
        return out

    @classmethod
    def from_body(cls, body: Body) -> SpillRequest:
        tenant, session, generation = _generation(body)
        route, share = body.get_str("route", "") or "", body.get_bool("share", True)
        return cls(tenant, session, generation, route, share, body.get_bool("fenced", False))


@dataclass(frozen=True)
class FillRequest:
    """Restore (tenant, session, generation) into a slot. `tokens`: the prompt it is restored for
    (a prompt leaving the generation early gets the part up to its checkpoint); `prefix`: the
    generation is another session's, restored only when the prompt shares enough of it."""

    tenant: str
    session: str
    generation: int
    tokens: list[int] | None = None
    prefix: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tenant": self.tenant, "session": self.session, "generation": self.generation}
        if self.tokens:
            out["tokens"] = self.tokens
        if self.prefix:
            out["prefix"] = True
        return out

    @classmethod
    def from_body(cls, body: Body) -> FillRequest:
        tenant, session, generation = _generation(body)
        tokens = _prompt_tokens(body.get_list("tokens"))
        return cls(tenant, session, generation, tokens, body.get_bool("prefix", False))


def _prompt_tokens(value: list[Any] | None) -> list[int] | None:
    """A fill's `tokens`: at most `MAX_FILL_TOKENS` ids, each a non-negative 32-bit integer."""
    if value is None:
        return None
    if len(value) > MAX_FILL_TOKENS:
        raise BadRequest(f"'tokens' holds {len(value)} ids, more than {MAX_FILL_TOKENS}", param="tokens")
    return check_tokens(value, 1 << 31, "tokens")  # the node does not know the vocabulary: any i32 id


# -- results --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Fields:
    """A result whose JSON is its fields, each under its name."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SpillResult(_Fields):
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

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SpillResult:
        return cls(
            str(data["tenant"]),
            str(data["session"]),
            int(data["generation"]),
            str(data["key"]),
            int(data["bytes"]),
            int(data["tokens"]),
            bool(data["uploaded"]),
            float(data["ms"]),
            int(data.get("written", 0)),
        )


@dataclass(frozen=True)
class FillResult(_Fields):
    """What was restored: `source` "local" (spill cache), "store", "cut" (the store's pieces up to
    a checkpoint) or "none" (a prefix the prompt does not share: the slot left as it was)."""

    tokens: int
    bytes: int
    source: str
    ms: float

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FillResult:
        return cls(int(data["tokens"]), int(data["bytes"]), str(data["source"]), float(data["ms"]))


@dataclass(frozen=True)
class EraseResult(_Fields):
    n_erased: int  # tokens the slot held

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EraseResult:
        return cls(int(data["n_erased"]))


@dataclass(frozen=True)
class CancelResult(_Fields):
    cancelled: bool  # False when no generation ran on the slot

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CancelResult:
        return cls(bool(data["cancelled"]))


SlotResult = SpillResult | FillResult | EraseResult | CancelResult


@dataclass(frozen=True)
class ForgetResult(_Fields):
    """The session's spill-cache files the node dropped (pending uploads included)."""

    tenant: str
    session: str
    n_files: int

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ForgetResult:
        return cls(str(data["tenant"]), str(data["session"]), int(data["n_files"]))


@dataclass(frozen=True)
class UnstoredCopy(_Fields):
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

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> UnstoredCopy:
        return cls(
            str(data["tenant"]),
            str(data["session"]),
            int(data["generation"]),
            str(data["key"]),
            int(data["bytes"]),
            int(data["tokens"]),
            str(data["model"]),
            float(data["saved_at"]),
        )


@dataclass(frozen=True)
class UnstoredList:
    node: str
    copies: tuple[UnstoredCopy, ...]

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "copies": [c.to_json() for c in self.copies]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> UnstoredList:
        return cls(str(data.get("node", "")), tuple(UnstoredCopy.from_json(c) for c in data["copies"]))


@dataclass(frozen=True)
class NodeHealth(_Fields):
    """`status` "ok", or "draining" (answered with 503: a load balancer stops sending work)."""

    status: str
    node: str

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NodeHealth:
        return cls(str(data["status"]), str(data.get("node", "")))


@dataclass(frozen=True)
class NodeEngine(_Fields):
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

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NodeEngine:
        return cls(
            str(data["id"]),
            str(data["model"]),
            data.get("url"),
            str(data["state"]),
            int(data["n_slots"]),
            int(data["restarts"]),
            data.get("pid"),
            str(data.get("instance") or ""),
            str(data.get("error") or ""),
            str(data.get("last_error") or ""),
        )


@dataclass(frozen=True)
class EngineList:
    node: str
    engines: tuple[NodeEngine, ...]

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "engines": [e.to_json() for e in self.engines]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EngineList:
        return cls(str(data.get("node", "")), tuple(NodeEngine.from_json(e) for e in data["engines"]))

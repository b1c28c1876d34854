"""The reuse report between the gateway and an engine: what a caller says of a turn (the request's
`slotkeeper` object) and how the prompt's state was served (the answer's `slotkeeper.served`),
defined once for both ends. Pure.

`served` values: `live` (the session's own slot), `restored` (its own stored state), `prefix`
(another slot's state on the engine, or the state another session of the tenant left in this one),
`stored-prefix` (the stored state of the session holding its shared prefix), `cold` (nothing),
`handoff` (prefilled on a prefill engine, its state installed here: engine_pool.protocol.handoff).
"""

from __future__ import annotations

from typing import NotRequired, TypedDict

from engine_pool.errors import BadRequest
from engine_pool.http.body import Body

SERVED = ("live", "restored", "prefix", "stored-prefix", "cold", "handoff")
MAX_RULES = 16


class ComparedState(TypedDict):
    """`prefix`: the state the prompt was compared with — its slot, its tokens, the prompt tokens of
    the last request it served, and the prompt's common prefix with it."""

    slot: int
    tokens: int
    prompt_tokens: int
    common: int


class Divergence(TypedDict):
    """`diverged`: where the prompt left that state (token `at`): `part` is `reply`, `system`,
    `tools`, `message` or `generation_prompt`; `message` and `role` name a message."""

    at: int
    part: str
    message: NotRequired[int]
    role: NotRequired[str]


class CallerContext(TypedDict, total=False):
    """What the caller says of a turn (the request's `slotkeeper` object)."""

    served: str
    rules: list[str]


class ReuseReport(CallerContext, total=False):
    """An answer's `slotkeeper` object: how the prompt's prefix was served. `reuse` is live |
    checkpoint | logits | none; `restored`: the slot's state came from a slot file; `source_slot`:
    the slot it started from; with the caller's `served` and `rules`. A stream's first chunk carries
    only `prompt_tokens` (the prompt's size once evaluated)."""

    reuse: str
    restored: bool
    checkpoints_created: int
    source_slot: int
    prefix: ComparedState
    diverged: Divergence
    prompt_tokens: int


def caller_context(body: Body) -> CallerContext:
    """What the caller (the gateway) says of this turn, to be reported beside the engine's own
    reuse facts in `slotkeeper`: how it served the session (`served`) and which of its prompt rules
    changed the request (`rules`). Bounded; anything else is a 400."""
    ctx = body.get_object("slotkeeper")
    if ctx is None:
        return {}
    out: CallerContext = {}
    served = ctx.get_str("served")
    if served is not None:
        if served not in SERVED:
            raise BadRequest(
                f"'slotkeeper.served' must be one of {', '.join(SERVED)}", param="slotkeeper.served"
            )
        out["served"] = served
    rules = ctx.get_list("rules")
    if rules is not None:
        ok = all(isinstance(r, str) and 0 < len(r) <= 64 for r in rules)
        if len(rules) > MAX_RULES or not ok:
            raise BadRequest(
                f"'slotkeeper.rules' must be at most {MAX_RULES} names of 1..64 characters",
                param="slotkeeper.rules",
            )
        out["rules"] = list(rules)
    return out


def served(report: ReuseReport, cache_n: int) -> str:
    """How the prompt's state was served (`slotkeeper.served`): `prefix` when it started from
    another slot's state, or reused any while the caller said its session had none (`cold`: the
    state another session of the tenant left in this slot); else the caller's word (`live`,
    `restored`, `stored-prefix`), else what the slot did."""
    said = report.get("served")
    if "source_slot" in report or (said == "cold" and cache_n > 0):
        return "prefix"
    if said:
        return str(said)
    if report.get("restored"):
        return "restored"
    return "live" if report.get("reuse", "none") != "none" else "cold"

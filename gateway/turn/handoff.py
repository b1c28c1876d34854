"""The prefill/decode split of a turn (engine_pool.protocol.handoff): a turn placed on a decode (or
mixed) engine whose uncached tail is long is prefilled on a prefill engine of its model — one on the
same node when there is one (the state moves through that node's disk), else one on another node
(the state goes node to node); the decode engine's node installs the state — attention KV,
recurrent state, the checkpoint ladder and the last logits — in the turn's slot, labelled with its
session, and the turn then goes to its slot as any other: the engine finds the whole prompt there
and samples the first token from the handed logits (0 prompt tokens evaluated), and the session
lives on in that slot.

`split_for` decides (pure): when the prompt's uncached tail (`uncached_tail`) is at least the
tenant's threshold — in a cold slot the whole prompt; in the slot a session is live in, or was
just restored into, what its prompt adds to the session's state (the node then carries that state
to the prefill slot first: 30k tokens of a tool's output on a running session are prefilled
there, not where other sessions decode) — but not for a turn that starts from another slot's state
on its engine (a shared prefix the prefill engine lacks), unless the threshold is 0.
`prefill_engine` picks one of the model's prefill engines, the decode engine's node's first (pure).
Two nodes that cannot reach each other (the decode engine's node answers `peer_unreachable`) hand a
new turn's state over through the store instead (`through_store`; engine_pool.pool.handoff_store).
`hand_off` carries it out; whatever goes wrong (no prefill engine, busy past `--handoff-wait-s`, a
prefill past `--handoff-timeout-s`, a failed prefill, a state the decode engine refuses) leaves the
turn unsplit, counted and logged with the reason: one turn slower, never an error. Tenants never
name engines.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from contextlib import suppress
from typing import Any

import structlog

from engine_pool.errors import ApiError
from engine_pool.protocol.handoff import HandoffOutcome, HandoffRequest, HandoffResult, handoff_key, stored_at
from gateway.cluster import EngineRef
from gateway.tenants import Tenant
from gateway.turn.engine_call import CHAT_PATH, input_tokens
from gateway.turn.parts import Turn, TurnParts, TurnSettings
from gateway.turn.prompt import Prompt
from gateway.turn.slot_choice import Placement, Serve
from storage.errors import StorageError

log = structlog.get_logger("slotkeeper.gateway")


def threshold_for(tenant: Tenant, settings: TurnSettings) -> int | None:
    """The tenant's threshold in uncached prompt tokens (its own, else the gateway's); None: never."""
    own = tenant.handoff_threshold
    if own is None:
        return settings.handoff_threshold
    return None if own < 0 else own


def may_split(placement: Placement, threshold: int | None) -> bool:
    """Whether the turn could be split at all, before its prompt's size is known."""
    if threshold is None or placement.handed_off:
        return False
    return threshold == 0 or placement.serve is not Serve.COLD or placement.prefix_from is None


def carries(placement: Placement) -> bool:
    """Whether a split of the turn carries its session's state to the prefill slot first: its slot
    holds it (live there, or restored there for this turn)."""
    return placement.serve is not Serve.COLD


def carried_from(placement: Placement, forked_from: str | None) -> str:
    """The session a carried slot's state is labelled with, when not the turn's own: a fork's (or a
    branch's) parent, restored there for this turn. '' otherwise."""
    return (forked_from or "") if carries(placement) else ""


def uncached_tail(placement: Placement, prompt_tokens: int | None, state_tokens: int) -> int | None:
    """The prompt tokens its slot would evaluate: all of them in a cold slot; those past the
    session's state (``state_tokens``) in its live or restored slot — at least: a prompt that
    renders the last reply anew first rolls back to the checkpoint before it. None: unknown."""
    if prompt_tokens is None:
        return None
    return prompt_tokens if not carries(placement) else max(0, prompt_tokens - state_tokens)


def split_for(placement: Placement, threshold: int | None, tail: int | None) -> bool:
    """Whether the turn is prefilled elsewhere: its uncached tail reaches the threshold."""
    if not may_split(placement, threshold):
        return False
    assert threshold is not None
    return threshold == 0 or (tail is not None and tail >= threshold)


def stays_whole(threshold: int | None, added_at_most: int | None, prefill_here: bool) -> bool:
    """Whether a warm turn is certainly not split, before its prompt is tokenized: no prefill engine
    of its model (``prefill_here``), no threshold, or what it adds to its session's state
    (``added_at_most``: a bound, None when unknown) stays below the threshold. Only such a turn may
    be sent early (gateway.turn.early): one that may be split waits for its opening read and for
    `split_for`."""
    if not prefill_here or threshold is None:
        return True
    return threshold > 0 and added_at_most is not None and added_at_most < threshold


def prefill_engine(engines: Sequence[EngineRef], node: str, turn_number: int = 0) -> EngineRef | None:
    """A prefill engine on ``node`` (the state moves through that node's disk), else on any other
    node (node to node), taken in turn (``turn_number``) when there are several; None when the
    model has none."""
    here = sorted((e for e in engines if e.node == node), key=lambda e: e.engine)
    pool = here or sorted(engines, key=lambda e: (e.node, e.engine))
    return pool[turn_number % len(pool)] if pool else None


class Handoffs:
    """The split turns of this process: carries `split_for`'s decision out (see the module doc)."""

    def __init__(self, parts: TurnParts) -> None:
        self.parts = parts
        self._turns = 0  # round robin over a node's prefill engines

    async def hand_off(self, turn: Turn, body: dict[str, Any], prompt: Prompt | None) -> Turn:
        """``turn`` with its prompt's state installed in its slot (`Placement.handed_off`), or as it
        was (whatever failed: counted and logged). ``body``: the engine's chat body as the turn
        sends it."""
        try:
            return await self._split(turn, body, prompt)
        except Exception as exc:  # the index or a node away: the turn runs unsplit all the same
            self._failed(turn, None, exc)
            return turn

    async def _split(self, turn: Turn, body: dict[str, Any], prompt: Prompt | None) -> Turn:
        parts, placement = self.parts, turn.placement
        threshold = threshold_for(turn.tenant, parts.settings)
        if prompt is None or not may_split(placement, threshold):
            return turn
        decode = await parts.cluster.engine(placement.engine)
        if decode is None:
            return turn
        prefill = prefill_engine(await parts.cluster.prefill_engines(turn.model), decode.node, self._turns)
        if prefill is None:
            return turn
        peer = ""
        if prefill.node != decode.node:  # node to node: the decode engine's node asks the prefill's
            peer = await parts.cluster.node_url(prefill.node) or ""
            if not peer:
                return turn
        tail = None
        if threshold:  # the prompt's size, as the decode engine tokenizes it
            tokens = await _prompt_tokens(parts, turn, prompt)
            record = turn.hold.record
            state = record.tokens if record is not None else 0
            tail = uncached_tail(placement, None if tokens is None else len(tokens), state)
        if not split_for(placement, threshold, tail):
            return turn
        self._turns += 1
        request = HandoffRequest(
            turn.tenant.name,
            turn.session,
            prefill.engine,
            body,
            mode=parts.settings.handoff,
            wait_s=parts.settings.handoff_wait_s,
            timeout_s=parts.settings.handoff_timeout_s,
            carry=carries(placement),
            prefill_node=peer,
            carry_from=carried_from(placement, turn.forked_from),
        )
        try:
            result = await turn.node.handoff(placement.engine, placement.slot, request)
        except ApiError as exc:
            if not through_store(exc, request):
                self._failed(turn, prefill, exc)
                return turn
            try:
                result = await self._through_store(turn, prefill, request)
            except ApiError as again:
                self._failed(turn, prefill, again)
                return turn
        self._done(turn, result)
        return dataclasses.replace(turn, placement=dataclasses.replace(placement, handed_off=True))

    async def _through_store(self, turn: Turn, prefill: EngineRef, request: HandoffRequest) -> HandoffResult:
        """The handoff through the store (engine_pool.pool.handoff_store): the prefill engine's node
        exports into a transient object, the decode engine's node installs from it; the object is
        deleted however it ends. The result: the decode node's, with the prefill's account."""
        parts, placement = self.parts, turn.placement
        key = handoff_key(uuid.uuid4().hex)
        try:
            prefill_node = await parts.node(prefill.node)
            ask = dataclasses.replace(request, prefill_node="", to_store=key)
            done = await prefill_node.prefill_to_store(prefill.engine, ask)
            install = dataclasses.replace(request, prefill_node="", from_store=key)
            got = await turn.node.handoff(placement.engine, placement.slot, install)
        finally:
            with suppress(StorageError):  # (left behind, it is bytes nothing reads)
                await parts.store.delete_object(stored_at(parts.store.prefix, key))
        return dataclasses.replace(
            got,
            prefill_slot=done.prefill_slot,
            prompt_n=done.prompt_n,
            prefill_ms=done.prefill_ms,
            export_ms=round(done.export_ms + got.export_ms, 2),
            prefill_node=request.prefill_node,
        )

    def _done(self, turn: Turn, result: HandoffResult) -> None:
        metrics = self.parts.metrics
        metrics.handoffs.labels(HandoffOutcome.DONE.value).inc()
        metrics.handoff_bytes.inc(result.bytes)
        metrics.handoff_seconds.observe(result.ms / 1000)
        log.info(
            "turn.handed_off",
            tenant=turn.tenant.name,
            session=turn.session,
            engine=turn.placement.engine,
            slot=turn.placement.slot,
            **result.to_json(),
        )

    def _failed(self, turn: Turn, prefill: EngineRef | None, exc: Exception) -> None:
        outcome = failure(exc)
        self.parts.metrics.handoffs.labels(outcome.value).inc()
        log.warning(
            "turn.handoff_failed",
            tenant=turn.tenant.name,
            session=turn.session,
            engine=turn.placement.engine,
            prefill=prefill.engine if prefill is not None else None,
            result=outcome.value,
            error=str(exc),
        )


def through_store(exc: Exception, request: HandoffRequest) -> bool:
    """Whether a failed node-to-node handoff goes through the store instead: the decode engine's
    node could not reach the prefill engine's at all (nothing was sent), and no state is carried
    (a carried turn runs unsplit)."""
    unreachable = isinstance(exc, ApiError) and exc.code == "peer_unreachable"
    return unreachable and bool(request.prefill_node) and not request.carry


def failure(exc: Exception) -> HandoffOutcome:
    """How a failed handoff counts: the decode engine refused the state (its slot-file checks: another
    model or format, damaged), no prefill slot in time (503), or anything else."""
    if not isinstance(exc, ApiError):
        return HandoffOutcome.FAILED
    if exc.extra.get("kind") is not None:
        return HandoffOutcome.REFUSED
    if exc.status == 503:
        return HandoffOutcome.UNAVAILABLE
    return HandoffOutcome.FAILED


async def _prompt_tokens(parts: TurnParts, turn: Turn, prompt: Prompt) -> list[int] | None:
    if parts.engines is None:
        return None
    return await input_tokens(parts.engines, turn.engine_url.rstrip("/") + CHAT_PATH, prompt.tokens_body())

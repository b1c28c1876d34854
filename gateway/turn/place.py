"""Placing a turn: its session's live slot, or a slot chosen over a pool view, made ready for it.

The choices are pure: `choose_placement` (gateway.turn.slot_choice) picks the slot; `refine` adds which
of the engine's slots and which session the prompt may start from; `slot_prep` says how the slot
is made ready (`SlotPrep`: fill the session's stored generation, fill another session's stored
prefix, clear it, or leave it). `place` gathers what they need and carries them out: it evicts
(gateway.turn.evict), fills and erases through the node agent, and asks the engine for the prompt's
tokens where a fill can stop at the prompt's checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import structlog

from engine_pool.errors import QuotaExceeded, Unavailable
from engine_pool.pool.client import NodeClient, NodeError
from engine_pool.protocol.node import FillProgress, FillResult
from gateway.cluster import EngineView
from gateway.tenants import Tenant
from gateway.turn.engine_call import CHAT_PATH, input_tokens
from gateway.turn.evict import evict
from gateway.turn.hold import SessionHold, write_record
from gateway.turn.parts import TurnParts
from gateway.turn.prompt import Prompt
from gateway.turn.slot_choice import (
    LiveSlotsExhausted,
    NoCapacity,
    Placement,
    Serve,
    SessionView,
    choose_placement,
    prefix_slots,
    reserved,
)
from storage.index.records import SessionRecord

log = structlog.get_logger("slotkeeper.gateway")


@dataclass(frozen=True)
class Placed:
    """Where the turn runs: the placement as carried out, the engine's URL and its node agent, and
    whether the opening read's busy mark was already the record's (`marked`: nothing to write)."""

    placement: Placement
    engine_url: str
    node: NodeClient
    marked: bool = False


class FillWatcher(Protocol):
    """Who watches a turn's fill (gateway.turn.restore_progress): told as the fill begins (where
    the turn runs) and how it ended, sent the node's reports in between."""

    def filling(
        self, session: str, placement: Placement, forked_from: str | None
    ) -> Callable[[FillProgress], None]:
        """The fill of ``placement``'s slot for ``session`` begins; the reports go to the answer."""
        ...

    def filled(self, result: FillResult | None) -> None:
        """The fill ended: what it restored, or None when it did not take (the prompt is then
        evaluated in full)."""
        ...


@dataclass(frozen=True)
class SlotPrep:
    """How a chosen slot is made ready before the turn runs in it (`place` carries it out)."""

    fill: str | None = None  # the session whose stored generation is filled into the slot
    generation: int = 0
    tokens: bool = False  # fill with the prompt's tokens (asked of the engine): cut at its checkpoint
    prefix: bool = False  # `fill` is the session holding this one's shared prefix, not its own state
    erase: bool = False  # clear the slot (a prefix fill that did not take clears it too)


def refine(
    placement: Placement,
    here: EngineView,
    tenant: str,
    holder: SessionRecord | None,
    forked: bool,
    shares: bool,
) -> Placement:
    """The placement with the slots of its engine the prompt may start from (the tenant's own,
    when its sessions share) and the session whose state that is (``prefix_from``). ``holder``: the
    session this one may start from (the parent of a fork, or the one holding its shared prefix)."""
    sources = prefix_slots(here, tenant, placement.slot) if shares else ()
    live_here = holder is not None and holder.live and holder.engine == placement.engine
    if forked and holder is not None and live_here:
        # The parent's slot is on this engine: the fork starts from its live state there.
        sources = tuple(dict.fromkeys((*sources, *(() if holder.slot is None else (holder.slot,)))))
        placement = replace(placement, serve=Serve.COLD)
    placement = replace(placement, prefix_slots=sources)
    # The holder's state is in one of those slots, or in this one (evicted from it, kept).
    if holder is not None and live_here and placement.serve is Serve.COLD:
        victim = placement.evict
        evicted = victim is not None and (victim.tenant, victim.session) == (tenant, holder.session)
        if holder.slot in sources or evicted:
            placement = replace(placement, prefix_from=holder.session)
    return placement


def slot_prep(
    placement: Placement,
    tenant: str,
    source: str,
    generation: int,
    holder: SessionRecord | None,
    cut: bool,
    prompt: Prompt | None,
    shares: bool,
) -> SlotPrep:
    """How the slot is made ready. Restored: ``source``'s ``generation`` (the session's own, or the
    parent's of a fork), cut at the prompt's checkpoint when ``cut``. Cold: filled with the stored
    prefix of the ``holder`` of its shared prefix when that one is not live on this engine (the
    engine continues from its checkpoint), else cleared — unless it holds the tenant's own session
    just evicted from it, whose state the engine may start from as from any of the tenant's slots
    (never another tenant's)."""
    if placement.serve is Serve.RESTORE:
        return SlotPrep(fill=source, generation=generation, tokens=cut)
    if placement.serve is not Serve.COLD:
        return SlotPrep()
    victim = placement.evict
    # A slot is never shared across tenants: clear what a dropped session left behind.
    erase = victim is None or victim.tenant != tenant or not shares
    live_here = holder is not None and holder.live and holder.engine == placement.engine
    if holder is not None and not live_here and holder.generation and prompt is not None:
        return SlotPrep(
            fill=holder.session, generation=holder.generation, tokens=True, prefix=True, erase=erase
        )
    return SlotPrep(erase=erase)


def marked_there(record: SessionRecord, placement: Placement, model: str) -> bool:
    """Whether the busy mark the opening read wrote on ``record`` is what placing the turn writes:
    served live in the same slot of the same model (the mark changed only its last use and dirt)."""
    return (
        placement.serve is Serve.LIVE
        and record.live_in(placement.engine, placement.slot)
        and record.model == model
    )


async def place(
    parts: TurnParts,
    tenant: Tenant,
    record: SessionRecord,
    model: str,
    forked_from: str | None,
    hold: SessionHold,
    prompt: Prompt | None = None,
    busy: bool = False,
    watcher: FillWatcher | None = None,
) -> Placed:
    """The turn's slot, made ready and recorded: the session live there, busy (unless the opening
    read's mark, ``busy``, says so already). The slot stays reserved (gateway.turn.reservations)
    until the index says who holds it. A fill that makes it ready is reported to ``watcher``."""
    placed = await _slot(parts, tenant, record, model, forked_from, hold, prompt, watcher)
    placement = placed.placement
    marked = busy and marked_there(record, placement, model)
    try:
        if not marked:
            decide = parts.index.decide_live(
                tenant.name,
                record.session,
                engine=placement.engine,
                slot=placement.slot,
                tokens=record.tokens,
                model=model,
            )
            await write_record(parts.index, hold, decide, idle=False)
    finally:  # recorded there now (or failed): the index says who holds the slot
        parts.reserved.release((placement.engine, placement.slot))
    return replace(placed, marked=marked)


async def _slot(
    parts: TurnParts,
    tenant: Tenant,
    record: SessionRecord,
    model: str,
    forked_from: str | None,
    hold: SessionHold,
    prompt: Prompt | None = None,
    watcher: FillWatcher | None = None,
) -> Placed:
    """The turn's slot, made ready and reserved (gateway.turn.reservations) until it is recorded."""
    if forked_from is None and (place := record.place) is not None:
        # Live in its slot (the common warm turn): the lock makes the slot ours, no pool view.
        engine_id, slot = place
        engine = await parts.cluster.engine(engine_id)
        if engine is not None and engine.model == model and slot < engine.n_slots:
            parts.reserved.hold((engine.engine, slot))
            try:
                node = await parts.node(engine.node)
            except BaseException:
                parts.reserved.release((engine.engine, slot))
                raise
            return Placed(Placement(engine.engine, slot, Serve.LIVE), engine.url, node)
    if hold.saved is not None and not hold.saved.done():
        # Served elsewhere: it needs the state its previous turn is saving right now.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(hold.saved), parts.settings.spill_wait_s)
        record = await parts.index.get(record.tenant, record.session)
        hold.record = record
    return await _place_by_pool_view(parts, tenant, record, model, forked_from, prompt, watcher)


async def _holder(
    parts: TurnParts,
    tenant: str,
    record: SessionRecord,
    forked_from: str | None,
    prompt: Prompt | None,
    shares: bool,
) -> SessionRecord | None:
    """The session whose state this one may start from: the parent of a fork, or — a session with
    no state of its own — the one holding its shared prefix (gateway.turn.prompt). (The digests are
    the model's: a holder's stored state is of it too. A reindexed record names the model by its
    fingerprint; the engine checks that when it restores.)"""
    if forked_from:
        return await parts.index.find(tenant, forked_from)
    if record.generation or not shares or prompt is None:
        return None
    for digest in prompt.sources():
        holder = await parts.index.find_shared(tenant, digest)
        if holder is not None and holder.session != record.session:
            return holder
    return None


async def _place_by_pool_view(
    parts: TurnParts,
    tenant: Tenant,
    record: SessionRecord,
    model: str,
    forked_from: str | None,
    prompt: Prompt | None,
    watcher: FillWatcher | None,
) -> Placed:
    shares = parts.shares(tenant.name)
    holder = await _holder(parts, tenant.name, record, forked_from, prompt, shares)
    generation = (holder.generation if holder else 0) if forked_from else record.generation
    prefer = holder.engine if holder is not None and holder.live and holder.model == model else None
    view = SessionView(tenant.name, record.session, record.engine, record.slot, generation)
    reservations = parts.reserved
    started = reservations.start_pool_view()
    try:
        pool_view, refs = await parts.cluster.pool_view(
            model,
            holder=(tenant.name, record.session),
            live_limit=tenant.quotas.live_slots,
            also=prefer,
        )
        # No await from here to the reservation: what this choice sees and the slot it holds
        # are one step for every other placement of this process (gateway.turn.reservations).
        views = reserved(pool_view, reservations.taken(started))
        placement = choose_placement(views, model, view, tenant.quotas.live_slots, prefer=prefer)
        reservations.hold((placement.engine, placement.slot))
    except NoCapacity as exc:
        raise Unavailable(f"no free slot for model {model!r}: {exc}", retry_after=2) from None
    except LiveSlotsExhausted as exc:
        raise QuotaExceeded(str(exc), retry_after=2) from None
    finally:
        reservations.end_pool_view(started)
    try:
        engine = refs[placement.engine]
        node = await parts.node(engine.node)
        here = next(v for v in views if v.engine == placement.engine)
        placement = refine(placement, here, tenant.name, holder, bool(forked_from), shares)
        victim = placement.evict
        if victim is not None and not await evict(parts, engine.engine, node, placement):
            # It was not there: the slot is free, and what it holds is nobody's to start from.
            kept = None if placement.prefix_from == victim.session else placement.prefix_from
            placement = replace(placement, evict=None, prefix_from=kept)
        # A restore for a prompt that leaves the stored conversation early (an edited message, a
        # branch) is cut at the prompt's checkpoint.
        stored = holder if forked_from else record
        cut = (
            placement.serve is Serve.RESTORE
            and prompt is not None
            and stored is not None
            and prompt.leaves(stored)
        )
        prep = slot_prep(
            placement, tenant.name, forked_from or record.session, generation, holder, cut, prompt, shares
        )
        placed = Placed(placement, engine.url, node)
        watch = Watch(watcher, record.session, forked_from)
        return await _prepare(parts, placed, prep, tenant.name, record.session, prompt, watch)
    except BaseException:
        reservations.release((placement.engine, placement.slot))
        raise


async def _prepare(
    parts: TurnParts,
    placed: Placed,
    prep: SlotPrep,
    tenant: str,
    session: str,
    prompt: Prompt | None,
    watch: Watch,
) -> Placed:
    """Carry `prep` out in the slot `placed` names; as served. A restore the node refuses (damaged,
    gone) is served cold instead; a node or store that is down fails this request (the session
    stays), unless the store is down and the tenant's policy says to re-prefill (`on_store_outage`)."""
    placement, node = placed.placement, placed.node
    try:
        if placement.serve is Serve.RESTORE:
            tokens = await _prompt_tokens(parts, prompt, placed.engine_url) if prep.tokens else None
            await _fill(placed, tenant, prep, tokens, watch)
        elif placement.serve is Serve.COLD:
            return await _prepare_cold(parts, placed, prep, tenant, prompt, watch)
    except NodeError as exc:
        store_down = exc.code == "store_unavailable"
        if placement.serve is Serve.RESTORE and exc.status < 500:
            log.warning("session.restore_failed", tenant=tenant, session=session, error=str(exc))
            parts.metrics.restore_failures.inc()
        elif placement.serve is Serve.RESTORE and store_down and parts.reprefills(tenant):
            # The store is down and the tenant would rather pay a full prefill than wait for it.
            log.warning("session.restore_deferred", tenant=tenant, session=session, error=str(exc))
            parts.metrics.store_outage_reprefills.inc()
        else:  # the node or its store is down: this request fails, the session stays as it was
            raise Unavailable(f"could not prepare the slot: {exc.message}", retry_after=1) from exc
        watch.filled(None)
        await node.erase(placement.engine, placement.slot)
        cold = replace(placement, serve=Serve.COLD, prefix_from=None, prefix_stored=False)
        return replace(placed, placement=cold)
    return placed


async def _prepare_cold(
    parts: TurnParts, placed: Placed, prep: SlotPrep, tenant: str, prompt: Prompt | None, watch: Watch
) -> Placed:
    placement = placed.placement
    if prep.prefix and prep.fill is not None:
        tokens = await _prompt_tokens(parts, prompt, placed.engine_url)
        if tokens:
            try:
                out = await _fill(placed, tenant, prep, tokens, watch)
            except NodeError as exc:
                # Damaged, gone, or the store away: the prompt is evaluated in full instead (the
                # same answer), and the slot is cleared below (a node that is down fails there).
                log.warning("session.prefix_fill_failed", tenant=tenant, holder=prep.fill, error=str(exc))
                parts.metrics.restore_failures.inc()
                watch.filled(None)
            else:
                if out.source != "none":
                    started = replace(placement, prefix_from=prep.fill, prefix_stored=True)
                    return replace(placed, placement=started)
    if prep.erase:
        await placed.node.erase(placement.engine, placement.slot)
    return placed


@dataclass(frozen=True)
class Watch:
    """A turn's `FillWatcher` (None: nobody watches) with what it is told of the turn's session."""

    watcher: FillWatcher | None
    session: str
    forked_from: str | None

    def filling(self, placement: Placement) -> Callable[[FillProgress], None] | None:
        if self.watcher is None:
            return None
        return self.watcher.filling(self.session, placement, self.forked_from)

    def filled(self, result: FillResult | None) -> None:
        if self.watcher is not None:
            self.watcher.filled(result)


async def _fill(
    placed: Placed, tenant: str, prep: SlotPrep, tokens: list[int] | None, watch: Watch
) -> FillResult:
    """Fill the slot with the stored generation `prep` names (a shared prefix when `prep.prefix`),
    reported to the turn's watcher."""
    assert prep.fill is not None
    where = placed.placement
    out = await placed.node.fill(
        where.engine,
        where.slot,
        tenant=tenant,
        session=prep.fill,
        generation=prep.generation,
        tokens=tokens,
        prefix=prep.prefix,
        progress=watch.filling(
            replace(where, prefix_from=prep.fill, prefix_stored=True) if prep.prefix else where
        ),
    )
    if out.source != "none":
        watch.filled(out)
    return out


async def _prompt_tokens(parts: TurnParts, prompt: Prompt | None, engine_url: str) -> list[int] | None:
    """The prompt's tokens as the engine at ``engine_url`` would evaluate them; None when it
    cannot say (asking is an optimisation)."""
    if prompt is None or parts.engines is None:
        return None
    return await input_tokens(parts.engines, engine_url.rstrip("/") + CHAT_PATH, prompt.tokens_body())

"""This process's turns, step by step: resolve the session, admit the turn, lock (or fork) and
place the session, mark it live in its slot; after the answer, its bookkeeping and save.

Each step is a module of its own that decides in pure functions and returns plain data:
gateway.turn.resolve, gateway.turn.opening (`Opening`: may the turn start before its opening read),
gateway.turn.hold, gateway.turn.place (`Placed`, `SlotPrep`), gateway.turn.evict, gateway.turn.close
(`Bookkeeping`), gateway.turn.save, gateway.turn.delete. `TurnRunner` strings them together and owns what
they share across turns of this process: the bookkeeping tasks in flight and what the opening
reads said of each tenant's admission. Every state change is a log event.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from gateway.healing import behind
from gateway.tenants import Tenant
from gateway.turn import close, delete
from gateway.turn.branch import Continuation, continuation, continues, looks_further
from gateway.turn.early import EarlyCall, EarlyStart
from gateway.turn.engine_call import TurnOutcome
from gateway.turn.handoff import Handoffs
from gateway.turn.hold import Phase, SessionHold, fork, hold_for_turn, write_record
from gateway.turn.opening import Admission, Admitted, Opening, discard, new_session_refusal, open_turn
from gateway.turn.parts import Turn, TurnParts
from gateway.turn.place import FillWatcher, Placed, place
from gateway.turn.prompt import Prompt
from gateway.turn.resolve import find_conversation, resolve
from gateway.turn.slot_choice import Serve
from storage.errors import StorageError
from storage.index.locks import SessionLock
from storage.index.records import SessionRecord
from storage.index.turnops import TurnStart

log = structlog.get_logger("slotkeeper.gateway")


def early_confirmed(early: EarlyStart | None, placed: Placed, instance: str | None) -> bool:
    """Whether the call launched before the opening read went where the turn was placed: the slot
    it was live in and that the read's busy mark already recorded (``placed.marked``), on the same
    engine process (``instance``, the cached engine's). The caller also asks that the hold be the
    lock the read kept."""
    if early is None or not placed.marked:
        return False
    where = (placed.placement.engine, placed.placement.slot, placed.engine_url)
    return where == (early.engine, early.slot, early.url) and instance == early.instance


@dataclass(frozen=True)
class Started:
    """A turn up to its engine call (`TurnRunner.start`): how its session was found, the placed turn,
    and the engine call its opening started early (None: none, or the opening read did not confirm
    it)."""

    found: tuple[str, str]
    turn: Turn
    early: EarlyCall[Any] | None


@dataclass(frozen=True)
class Branched:
    """Where a turn that does not continue its session runs instead (`TurnRunner._branch`)."""

    session: str
    hold: SessionHold
    record: SessionRecord | None  # None: a new branch (its record is created as it is placed)
    parent: str | None  # the session a new branch starts from (None: an existing session goes on)
    source: str


class TurnRunner:
    """The turns of this process (see the module doc). One per process, built in the lifespan."""

    def __init__(self, parts: TurnParts) -> None:
        self.parts = parts
        self._tasks: set[asyncio.Task[None]] = set()  # bookkeeping in flight (finish_soon)
        self._admission: dict[str, Admission] = {}  # by tenant (names from the tenants file: bounded)
        self.handoffs = Handoffs(parts)  # turns prefilled on a prefill engine (gateway.turn.handoff)

    # ---------------------------------------------------------------------------------- resolve
    async def resolve(
        self,
        tenant: Tenant,
        headers: Mapping[str, str],
        body: Mapping[str, Any],
        prompt: Prompt | None,
    ) -> tuple[str, str]:
        """The session a request names, finds implicitly, or a new one (gateway.turn.resolve)."""
        return await resolve(self.parts, tenant, headers, body, prompt)

    # ------------------------------------------------------------------------------------ start
    async def start(
        self,
        tenant: Tenant,
        headers: Mapping[str, str],
        body: Mapping[str, Any],
        model: str,
        prompt: Prompt | None,
        found: tuple[str, str] | None = None,
        launch: Callable[[str, EarlyStart], EarlyCall[Any]] | None = None,
        watcher: FillWatcher | None = None,
    ) -> Started:
        """One turn up to its engine call: its session resolved (unless ``found`` says where it is
        already), opened (gateway.turn.opening: ``launch(session, where)`` starts the engine call early
        where the opening may), held, branched where its prompt does not go on from the session's
        state (gateway.turn.branch), placed and marked live in its slot. A warm turn (the session
        live in its slot) makes one Redis round trip here: the opening read, which also marks it
        busy there. `Started.early` is the call started early once placing confirmed it. A fill of
        its slot is reported to ``watcher`` (gateway.turn.restore_progress)."""
        found = found or await resolve(self.parts, tenant, headers, body, prompt)
        session, source = found

        def goes_on(record: SessionRecord | None) -> bool:
            return continuation(record, prompt) is Continuation.EXACT

        def adds(record: SessionRecord) -> int | None:  # (a turn without a chat prompt is never split)
            return 0 if prompt is None else prompt.added_at_most(record.head) if record.head else None

        opened = await open_turn(
            self.parts,
            self._admission,
            tenant,
            session,
            model,
            goes_on,
            functools.partial(launch, session) if launch is not None else None,
            adds,
        )
        try:
            turn = await self._begin(opened.opening, opened.admitted, source, prompt, watcher)
        except BaseException:
            discard(self.parts, opened.early)
            with contextlib.suppress(StorageError):  # Redis away: the place lapses with its TTL
                await self.parts.index.release_inflight(tenant.name, opened.admitted.start.inflight_token)
            raise
        early = opened.early
        if early is not None and not turn.early:  # the opening read did not confirm it: never made
            discard(self.parts, early)
            early = None
        return Started(found, turn, early)

    async def _begin(
        self,
        opening: Opening,
        admitted: Admitted,
        source: str,
        prompt: Prompt | None,
        watcher: FillWatcher | None = None,
    ) -> Turn:
        parts, tenant, model, session = self.parts, opening.tenant, opening.model, opening.session
        start, own, early = admitted.start, admitted.own, opening.early
        hold = own or await hold_for_turn(parts, tenant.name, session, start)
        busy = start.busy  # the opening read marked the session busy in its live slot
        forked_from = None
        if hold is None:  # busy with another request: fork it
            forked_from = session
            session, hold = await fork(parts, tenant.name, session)
            source = "fork"
            busy = False
        created = False
        try:
            record = await self._record(hold, tenant.name, session, source, start.lock)
            how = continuation(record, prompt) if forked_from is None else Continuation.EXACT
            if how is Continuation.NONE or (how is Continuation.REPLY and looks_further(source)):
                # Not where its state is: never roll it back (gateway.turn.branch).
                assert record is not None and prompt is not None
                room = new_session_refusal(tenant, start) is None
                branched = await self._branch(hold, busy, record, source, prompt, how, room)
                if branched.hold is not hold:
                    hold, busy, source = branched.hold, False, branched.source
                    session, record, forked_from = branched.session, branched.record, branched.parent
            if record is None:
                refused = new_session_refusal(tenant, start)
                if refused is not None:
                    raise refused
                record = await parts.index.create(tenant.name, session, model=model)
                hold.record, created = record, True
            placed = await place(parts, tenant, record, model, forked_from, hold, prompt, busy, watcher)
            busy = False  # the record says where the turn runs
            placement = placed.placement
            instance = (
                None
                if early is None
                else getattr(parts.cluster.cached_engine(early.engine), "instance", None)
            )
            confirmed = hold is own and start.kept and early_confirmed(early, placed, instance)
            # Counted (`served`) and said by the turn's access line (its `cache`): at debug here.
            log.debug(
                "session.placed",
                tenant=tenant.name,
                session=session,
                engine=placement.engine,
                slot=placement.slot,
                serve=placement.serve.value,
                source=source,
            )
            # A session records its shared prefix when a turn places it in a slot (new, restored,
            # forked): a warm turn does not hash its tools and system prompt again.
            shared = None
            if prompt is not None and placement.serve is not Serve.LIVE and parts.shares(tenant.name):
                shared = prompt.shared
            return Turn(
                tenant,
                session,
                model,
                hold,
                placement,
                placed.engine_url,
                placed.node,
                source,
                forked_from,
                start.inflight_token,
                early=confirmed,
                shared=shared,
                prompt=prompt,
                created=created,
            )
        except BaseException:
            try:
                if created:  # a failed placement leaves no record behind (it would count toward quotas)
                    with contextlib.suppress(StorageError):
                        await parts.index.delete(tenant.name, session, lock=hold.lock)
                elif busy:  # marked busy by the opening read, but no turn runs: idle in its slot again
                    with contextlib.suppress(StorageError):
                        await write_record(parts.index, hold, parts.index.decide_idle(session), idle=True)
            finally:  # (also when cancelled meanwhile: the lock is never left held)
                await parts.holds.let_go(hold, turn=True)
            raise

    async def _record(
        self, hold: SessionHold, tenant: str, session: str, source: str, read_under: SessionLock | None
    ) -> SessionRecord | None:
        """The session's current record: the opening read's where the hold is the lock that read
        took (``read_under``), else read again; a lost record recovered and one behind a save it
        never learned of caught up (gateway.healing)."""
        parts, record = self.parts, hold.record
        if record is None and hold.lock is not read_under:
            record = await parts.index.find(tenant, session)
        if record is None and parts.healing is not None and source not in ("new", "fork"):
            record = hold.record = await parts.healing.recover(tenant, session)
        elif record is not None and parts.healing is not None and behind(record):
            record = hold.record = await parts.healing.catch_up(record)
        return record

    async def _branch(
        self,
        hold: SessionHold,
        busy: bool,
        record: SessionRecord,
        source: str,
        prompt: Prompt,
        how: Continuation,
        room: bool,
    ) -> Branched:
        """Where a turn goes whose prompt does not go on exactly from the state of the session it
        reached (``record``, held by ``hold``; marked busy by the opening read when ``busy``): for a
        request that names its session (gateway.turn.branch), the session its history continues — when
        only the reply differs (``how``), only one that recorded this very reply, else the reached
        session after all (returned with ``hold``) —; else a new branch from the session that shares
        most of the history — unless the tenant's quotas leave no ``room`` for a new session: then
        the turn runs on the reached session after all, as it did before branches (it rolls back;
        an edit gets an answer rather than a 429). Exactly one session's lock is held throughout:
        another is taken before the reached session is left as it was."""
        parts, tenant = self.parts, record.tenant
        parent = record.session
        hit = await find_conversation(parts, tenant, prompt) if looks_further(source) else None
        if hit is not None and how is Continuation.REPLY and hit[0] not in prompt.turns:
            hit = None  # found by a head, which the reached session's is too: it may be either's
        found = hit[1] if hit is not None else None
        if found is not None and found != parent:
            there = await self._continued(tenant, found, prompt)
            if there is not None:
                await self._leave(hold, busy)
                log.info("session.branch_found", tenant=tenant, session=found, named=parent, source=source)
                return Branched(found, there, there.record, None, source)
            parent = found  # it holds more of the prompt than the session named
        elif how is Continuation.REPLY:
            return Branched(parent, hold, record, None, source)  # nobody else has its reply: go on
        if not room:
            log.info("session.branch_refused", tenant=tenant, session=record.session, why="quota")
            parts.metrics.branches_refused.inc()
            return Branched(record.session, hold, record, None, source)
        session, branch = await fork(parts, tenant, parent)
        await self._leave(hold, busy)
        log.info("session.branched", tenant=tenant, session=session, parent=parent, source=source)
        parts.metrics.branches.labels(source).inc()
        return Branched(session, branch, None, parent, "branch")

    async def _continued(self, tenant: str, session: str, prompt: Prompt) -> SessionHold | None:
        """``session``'s lock, taken for this turn, when the prompt continues its state; else None
        (it is busy with another request, or its state is elsewhere in its conversation)."""
        parts = self.parts
        hold = await hold_for_turn(parts, tenant, session, TurnStart())
        if hold is None:
            return None
        try:
            if hold.record is None:
                hold.record = await parts.index.find(tenant, session)
        except BaseException:
            await parts.holds.let_go(hold, turn=True)
            raise
        if hold.record is not None and continues(hold.record, prompt):
            return hold
        await parts.holds.let_go(hold, turn=True)
        return None

    async def _leave(self, hold: SessionHold, busy: bool) -> None:
        """Let go of a session the turn does not run on after all, idle in its slot again when the
        opening read marked it busy there."""
        try:
            if busy:
                with contextlib.suppress(StorageError):
                    await write_record(
                        self.parts.index, hold, self.parts.index.decide_idle(hold.lock.session), idle=True
                    )
        finally:
            await self.parts.holds.let_go(hold, turn=True)

    # ----------------------------------------------------------------------------------- finish
    def answered(self, turn: Turn) -> None:
        """The turn's answer is going out (call before it does): from now on a request for the
        session waits for this turn's bookkeeping (`finish`) instead of forking it."""
        self.parts.holds.answered(turn.hold)

    def finish_soon(self, turn: Turn, messages: Sequence[Mapping[str, Any]], outcome: TurnOutcome) -> None:
        """`finish` as a task beside the answer going out (marked answered first, synchronously).
        Once per turn: gateway.turn.forward.Ending calls it (or `finish_now`) exactly once."""
        self.answered(turn)
        task = asyncio.create_task(self.finish(turn, messages, outcome), name=f"finish:{turn.session}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def finish_now(
        self, turn: Turn, messages: Sequence[Mapping[str, Any]], outcome: TurnOutcome
    ) -> None:
        """`finish`, awaited here (instead of `finish_soon`): for a turn placed again at once, which
        must find its session's record as this one leaves it."""
        self.answered(turn)
        await self.finish(turn, messages, outcome)

    async def finish(self, turn: Turn, messages: Sequence[Mapping[str, Any]], outcome: TurnOutcome) -> None:
        """Bookkeeping after the engine answered (or failed), in one round trip (gateway.turn.close).
        Never raises."""
        await close.finish(self.parts, turn, messages, outcome)

    async def settled(self, tenant: str, session: str) -> None:
        """Wait until this process's last turn of the session has written its bookkeeping (what
        a read of the session right after an answer must see)."""
        hold = self.parts.holds.get(tenant, session)
        if hold is not None and hold.phase is Phase.ANSWERED:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(hold.booked.wait(), self.parts.settings.spill_wait_s)

    async def drain(self) -> None:
        """Wait for the bookkeeping and write-behind saves in flight (shutdown)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.parts.holds.drain()

    # ----------------------------------------------------------------------------------- delete
    async def delete(self, tenant: Tenant, session: str) -> SessionRecord:
        """Remove every copy of the session (gateway.turn.delete)."""
        return await delete.delete(self.parts, tenant, session)

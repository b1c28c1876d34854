"""This gateway's hold on a session's lock, shared by the turn that runs on it and that turn's
write-behind save.

The session lock (storage.index.locks) keeps every other request, eviction and delete off a session
while a turn runs and while its state is being saved. The save, though, is this process's own
work: the client's next turn on the same slot does not need it (the slot holds the state), so it
must not wait for it. A `SessionHold` lets the next turn of this process take the lock over from
its own save instead of waiting for the release: the lock stays held (renewed by one keeper) until
the last of its users — the running turn, the pending save — lets go.

A hold is in one of three phases:
- RUNNING: a turn is running on the engine. Another request for the session forks it.
- ANSWERED: the turn answered; its bookkeeping (the record back to idle, routes, usage) is being
  written. A next turn waits for that (one round trip), then takes the hold over.
- SETTLING: only the write-behind save holds it — or, with no save to follow, the hold lingers
  `save_grace_s` (`Holds.linger`). A next turn takes it over at once; it waits for the save only
  when it needs the saved state (it is not served live in its slot).

`PHASES` is the table of which phase may follow which, and `enter` the one function that changes
a hold's phase: it refuses anything else (a bug, not a runtime condition), as the supervisor's
table does for engines.

The hold also keeps the session record as this process last wrote it, so that the next write is a
one-round-trip compare-and-set against it (storage.index.turnops); `write` serialises this process's
writes to the record, so the turn and the save never race each other's compare-and-set.

A turn's hold on its session's lock: taken, taken over, waited for — or, while a request runs
on the session, a fork of it under a fresh id.

Only a turn running on the session is forked around: the lock's token says what holds it
(storage.index.locks), and the gateway's own work on a session — an eviction saving it, a delete —
is waited for (there is no running state to fork from, and a fork would start the conversation
anew). A live holder renews its lock every third of the TTL (gateway.turn.hold), so a turn's lock
found below half its TTL was not renewed in time: its gateway died. `wait_or_fork` decides from
those two alone whether to wait for the lock or fork its session; the rest of `_lock` gathers what
it needs, cheapest question first.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Mapping
from enum import StrEnum
from typing import TYPE_CHECKING

import structlog

from storage.errors import LockBusy, LockLost, StorageError, StoreUnavailable
from storage.ids import validate_id
from storage.index.locks import TURN, WORK, SessionLock, SessionLocks
from storage.index.records import SessionRecord
from storage.index.session_index import Decide, SessionIndex
from storage.index.turnops import Ops, TurnStart

if TYPE_CHECKING:
    from gateway.turn.parts import TurnParts

log = structlog.get_logger("slotkeeper.gateway")


class Phase(StrEnum):
    RUNNING = "running"
    ANSWERED = "answered"
    SETTLING = "settling"


# Which phase may follow which: a turn answers (its bookkeeping pending) or ends before answering;
# the bookkeeping written, only a save (or the linger) holds it; a next turn takes it over. A turn's
# answer may be marked twice (its stream's end and its response's background both settle it).
PHASES: Mapping[Phase, frozenset[Phase]] = {
    Phase.RUNNING: frozenset({Phase.ANSWERED, Phase.SETTLING}),
    Phase.ANSWERED: frozenset({Phase.ANSWERED, Phase.SETTLING}),
    Phase.SETTLING: frozenset({Phase.RUNNING}),
}


class SessionHold:
    """One session's lock as held by this process (see the module doc). Owned by `Holds`."""

    def __init__(self, lock: SessionLock, record: SessionRecord | None) -> None:
        self.lock = lock
        self.record = record  # as this process last wrote or read it (None: unknown, re-read)
        # Certainly held until then (time.monotonic(); 0: not known): the lock's `since` + TTL,
        # pushed on by every renewal. A turn may run before Redis confirms the lock only inside it.
        self.valid_until = lock.since + lock.ttl_s if lock.since else 0.0
        self.phase = Phase.RUNNING
        self.users = 1  # the running turn; a pending save adds one
        self.booked = asyncio.Event()  # set while no turn's bookkeeping is pending
        self.booked.set()
        # The routes that pending bookkeeping writes (Holds.routed); None: not known yet, or none pending.
        self.routing: frozenset[str] | None = None
        self.saved: asyncio.Task[None] | None = None  # the write-behind saves running, if any
        self.next_save: Callable[[], Awaitable[None]] | None = None  # the newest save waiting
        self.gave_way = False  # the last save's grace ended with a next turn running: no grace now
        self.released = asyncio.get_running_loop().create_future()
        self.keeper: asyncio.Task[None] | None = None  # renews the lock (set by `Holds.start`)
        self._writing = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def writing(self) -> AsyncIterator[None]:
        """One write to the record at a time from this process (see the module doc)."""
        async with self._writing:
            yield


def enter(hold: SessionHold, phase: Phase) -> None:
    """Move ``hold`` to ``phase``; anything `PHASES` does not allow is a bug (AssertionError)."""
    if phase not in PHASES[hold.phase]:
        raise AssertionError(f"hold on {hold.lock.session}: no phase change {hold.phase} -> {phase}")
    hold.phase = phase


async def write_record(
    index: SessionIndex,
    hold: SessionHold,
    decide: Decide,
    *,
    idle: bool | None = None,
    also: Callable[[Ops], None] | None = None,
) -> tuple[SessionRecord, bool]:
    """One transition of the held session's record: a one-round-trip compare-and-set against the
    record this process last saw (with `also`'s writes), else the transaction. Returns the new
    record and whether `also`'s writes were made (the caller makes them otherwise)."""
    lock = hold.lock
    async with hold.writing():
        new = None
        if hold.record is not None:
            new = await index.apply(hold.record, decide, lock=lock, idle=idle, also=also)
        done = new is not None
        if new is None:
            new = await index.transition(lock.tenant, lock.session, decide, lock=lock, idle=idle)
        hold.record = new
        return new, done


class Holds:
    """The sessions whose lock this process holds, by (tenant, session): the one owner of that map.
    Every method runs on the event loop; the transitions are synchronous where they must not
    interleave with another request's check."""

    def __init__(
        self,
        locks: SessionLocks,
        lock_ttl_s: float,
        save_grace_s: float = 0.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._locks = locks
        self._ttl_s = lock_ttl_s
        self._grace_s = save_grace_s
        self._sleep = sleep  # the grace's (tests may inject it)
        self._holds: dict[tuple[str, str], SessionHold] = {}
        self._releasing: set[asyncio.Task[None]] = set()  # releases waiting for Redis to answer
        self._lingering: set[asyncio.Task[None]] = set()  # holds kept a moment after a turn (linger)
        self._booking: dict[str, set[SessionHold]] = {}  # by tenant: answered, bookkeeping unwritten

    def get(self, tenant: str, session: str) -> SessionHold | None:
        return self._holds.get((tenant, session))

    def start(self, lock: SessionLock, record: SessionRecord | None) -> SessionHold:
        """A turn took the lock from Redis: hold it (RUNNING), renewing it until released."""
        key = (lock.tenant, lock.session)
        if key in self._holds:  # Redis gave the lock out again: the hold here lost it (it expired)
            log.warning("session.hold_lost", tenant=key[0], session=key[1])
        hold = SessionHold(lock, record)
        # The keeper belongs to the hold, which outlives the turn that took it: it runs in a context
        # of its own, not in the request's (whose log fields and per-request variables it would carry).
        hold.keeper = asyncio.create_task(
            self._keep(hold), name=f"lock-keeper:{key}", context=contextvars.Context()
        )
        self._holds[key] = hold
        return hold

    async def take_over(self, hold: SessionHold) -> bool:
        """A new turn of the session shares the hold of its previous turn, once that turn's
        bookkeeping is written. False when a turn is running on it (the caller forks) or the
        hold was released meanwhile (the caller takes the lock from Redis)."""
        if hold.phase is Phase.RUNNING:
            return False
        await hold.booked.wait()
        if hold.released.done() or hold.phase is Phase.RUNNING:  # released, or another request won
            return False
        enter(hold, Phase.RUNNING)
        hold.users += 1
        return True

    def answered(self, hold: SessionHold, routes: Iterable[str] | None = None) -> None:
        """The turn's answer is going out; its bookkeeping starts (synchronous: a request arriving
        from now on waits for the bookkeeping instead of forking). ``routes``: what the bookkeeping
        writes for implicit routing, once known (a lookup for other routes need not wait for it)."""
        enter(hold, Phase.ANSWERED)
        hold.booked.clear()
        if routes is not None:
            hold.routing = frozenset(routes)
        self._booking.setdefault(hold.lock.tenant, set()).add(hold)

    def booked(self, hold: SessionHold) -> None:
        """The turn's bookkeeping is written; the hold now only waits for a pending save."""
        if hold.phase is Phase.ANSWERED:
            enter(hold, Phase.SETTLING)
        self._written(hold)

    def _written(self, hold: SessionHold) -> None:
        hold.booked.set()
        hold.routing = None
        tenant = hold.lock.tenant
        booking = self._booking.get(tenant)
        if booking is not None:
            booking.discard(hold)
            if not booking:
                del self._booking[tenant]

    async def routed(self, tenant: str, lookup: Collection[str], wait_s: float) -> None:
        """Wait (at most ``wait_s``) until the turns of the tenant this process answered have
        written the routes a lookup for ``lookup`` may find (those whose routes are not known yet
        included). A client sends its next turn the moment the answer arrives, and the bookkeeping
        goes out beside the answer (gateway.turn.close): a lookup by history (gateway.turn.resolve)
        must find the session that answered, not miss it by a round trip. Returns at once when no
        such bookkeeping is being written."""
        booking = self._booking.get(tenant, ())
        waits = [
            hold.booked.wait()
            for hold in booking
            if hold.routing is None or not hold.routing.isdisjoint(lookup)
        ]
        if not waits:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*waits), wait_s)

    def saving(self, hold: SessionHold, save: Callable[[], Awaitable[None]]) -> None:
        """Save the session's state behind the answer, as one more user of the hold. Saves
        coalesce: while one runs, a newer turn's save waits and only the newest waiting one runs
        next (it saves the newest state), so back-to-back turns never pile saves up. A save starts
        ``save_grace_s`` after it is asked for: a next turn sent at once takes the slot first (the
        save then finds the session busy and leaves it to that turn's own save). Only one save in
        a row gives way: the next starts at once, so a burst of turns still saves every other one."""
        hold.next_save = save
        if hold.saved is None or hold.saved.done():
            hold.users += 1
            name = f"write-behind:{hold.lock.tenant}/{hold.lock.session}"
            hold.saved = asyncio.create_task(self._saves(hold), name=name)

    @property
    def lingers(self) -> bool:
        """Whether `linger` keeps a hold at all (a grace is set): else the lock goes with the turn."""
        return bool(self._grace_s)

    def linger(self, hold: SessionHold) -> None:
        """Keep the hold ``save_grace_s`` after a turn that no save follows (an ``on-evict``
        tenant's), as one more user of it: a next turn sent at once takes it over — and starts
        beside its opening read (gateway.turn.early) — instead of taking the lock from Redis. Anyone else
        (an eviction, a delete, another gateway) waits that moment for the lock."""
        if not self._grace_s:
            return
        hold.users += 1
        name = f"linger:{hold.lock.tenant}/{hold.lock.session}"
        task = asyncio.create_task(self._linger(hold), name=name)
        self._lingering.add(task)
        task.add_done_callback(self._lingering.discard)

    async def _linger(self, hold: SessionHold) -> None:
        try:
            await self._sleep(self._grace_s)  # a debounce, as a save's grace
        finally:
            await self.let_go(hold)

    async def _saves(self, hold: SessionHold) -> None:
        try:
            while hold.next_save is not None:
                if self._grace_s and not hold.gave_way:
                    await self._sleep(self._grace_s)  # a debounce, not a wait for a condition
                    hold.gave_way = hold.phase is Phase.RUNNING
                else:
                    hold.gave_way = False
                save, hold.next_save = hold.next_save, None
                await save()
        finally:
            await self.let_go(hold)

    async def let_go(self, hold: SessionHold, *, released: bool = False, turn: bool = False) -> None:
        """One user is done; the last one releases the lock (``released``: the user's own guarded
        write already deleted it). ``turn``: the user is a turn that ended before answering (its
        placement failed): a save still holding the hold may be taken over again."""
        hold.users -= 1
        if turn and hold.phase is Phase.RUNNING:
            enter(hold, Phase.SETTLING)
        if hold.users > 0:
            return
        key = (hold.lock.tenant, hold.lock.session)
        if self._holds.get(key) is hold:
            del self._holds[key]
        hold.valid_until = 0.0  # (being released: never run a turn on it before Redis says so)
        if hold.keeper is not None:
            hold.keeper.cancel()
        try:
            if not released:
                await self._locks.release(hold.lock)
        except StoreUnavailable as exc:  # Redis away: released when it answers (or it lapses)
            log.warning("session.release_failed", tenant=key[0], session=key[1], error=str(exc))
            task = asyncio.create_task(self._release_later(hold.lock), name=f"release:{key}")
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)
        except StorageError as exc:  # lost: expired and taken over
            log.warning("session.release_failed", tenant=key[0], session=key[1], error=str(exc))
        finally:
            self._written(hold)
            if not hold.released.done():
                hold.released.set_result(None)

    async def _release_later(self, lock: SessionLock, every_s: float = 0.5) -> None:
        """Release ``lock`` once Redis answers again, so that the session's next turn need not wait
        out the lock's TTL after a blip; given up when the lock lapses by itself (a token that is
        no longer ours is never deleted: the release compares it)."""
        deadline = asyncio.get_running_loop().time() + self._ttl_s
        while asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(every_s)  # a retry's pace: Redis gives no signal when it is back
            try:
                await self._locks.release(lock)
            except StoreUnavailable:
                continue
            except StorageError:  # lapsed and taken over meanwhile: nothing of ours to release
                return
            log.info("session.released_late", tenant=lock.tenant, session=lock.session)
            return

    def last_user(self, hold: SessionHold) -> bool:
        """Whether letting go now would release the lock (no save pending)."""
        return hold.users == 1

    async def drain(self) -> None:
        """Wait until every hold is released (shutdown)."""
        while self._holds:
            await asyncio.gather(*(h.released for h in list(self._holds.values())), return_exceptions=True)

    async def _keep(self, hold: SessionHold) -> None:
        """Renew the lock every third of its TTL until cancelled (released)."""
        lock = hold.lock
        while True:
            await asyncio.sleep(self._ttl_s / 3)
            if (
                hold.released.done()
            ):  # (its cancellation was lost: see engine_pool.process.loop.cancel_and_wait)
                return
            try:
                renewed = await self._locks.extend(lock)
                hold.valid_until = renewed.since + renewed.ttl_s
            except LockLost:
                hold.valid_until = 0.0
                log.error("session.lock_lost", tenant=lock.tenant, session=lock.session)
                return
            except StorageError as exc:  # Redis down a moment: try again at the next tick
                log.warning(
                    "session.lock_renew_failed", tenant=lock.tenant, session=lock.session, error=str(exc)
                )


def fork_id(session: str) -> str:
    """A fresh id for a fork of `session`: valid whatever the parent's id ends with, at most 128
    characters (a parent like `dot2.` would otherwise give `dot2..fXXXX`, which ids refuse)."""
    base = session[:110].rstrip(".") or "s"
    return validate_id(f"{base}.f{secrets.token_hex(4)}", "fork id")


def wait_or_fork(
    holder: str | None, remaining_s: float | None, lock_ttl_s: float, work_wait_s: float
) -> float | None:
    """How long to wait for a lock another process holds on a session that is busy (None: fork
    it). The gateway's work (``WORK``) is waited for ``work_wait_s``. A turn that renews keeps its
    lock above two thirds of the TTL, so one at half or above is alive: forked around; below, it
    died: wait for its lock to lapse, never fork."""
    if holder == WORK:
        return work_wait_s
    if remaining_s is not None and remaining_s >= lock_ttl_s / 2:
        return None
    return (remaining_s or 0.0) + 1.0


async def hold_for_turn(parts: TurnParts, tenant: str, session: str, start: TurnStart) -> SessionHold | None:
    """The session's lock for this turn when this process did not hold it already: taken by the
    opening read, taken over from this process's own previous turn of the session (one that began
    settling meanwhile), or waited for; None when a request runs on it (the caller forks)."""
    if start.lock is not None:
        return parts.holds.start(start.lock, start.record)
    own = parts.holds.get(tenant, session)
    if own is not None and await parts.holds.take_over(own):
        return own
    lock = await _lock(parts, tenant, session)
    return None if lock is None else parts.holds.start(lock, None)


async def fork(parts: TurnParts, tenant: str, session: str) -> tuple[str, SessionHold]:
    """A fork of the busy session: a fresh id (gateway.turn.hold.fork_id), locked and held for the turn."""
    forked = fork_id(session)
    lock = await parts.locks.try_acquire(tenant, forked, ttl_s=parts.settings.lock_ttl_s, holder=TURN)
    assert lock is not None
    return forked, parts.holds.start(lock, None)


async def _lock(parts: TurnParts, tenant: str, session: str) -> SessionLock | None:
    """The session's lock, waiting where its holder is only settling or dead; None when a live
    request holds it (the caller forks)."""
    ttl_s, spill_wait_s = parts.settings.lock_ttl_s, parts.settings.spill_wait_s
    lock = await parts.locks.try_acquire(tenant, session, ttl_s=ttl_s, holder=TURN)
    if lock is not None:
        return lock
    own = parts.holds.get(tenant, session)
    wait: float | None
    if own is not None:  # our own: a turn runs on it (fork), or it is being released (wait)
        if own.phase is Phase.RUNNING:
            return None
        wait = spill_wait_s
    elif await parts.index.find(tenant, session) is None or await parts.index.is_idle(tenant, session):
        # No request runs on it: a delete, an eviction or another replica's save of its last turn
        # holds the lock a moment. There is nothing to fork from anyway: wait.
        wait = spill_wait_s
    else:
        wait = wait_or_fork(*await parts.locks.holder(tenant, session), ttl_s, spill_wait_s)
        if wait is None:
            return None
    with contextlib.suppress(LockBusy):
        return await parts.locks.acquire(tenant, session, ttl_s=ttl_s, wait_s=wait, holder=TURN)
    return None

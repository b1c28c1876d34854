"""A warm turn sent to its engine before its opening read returns.

A warm turn makes one Redis round trip before the engine call: the opening read
(storage.index.turnops), which admits the request, takes or confirms the session's lock, reads the
record and marks the session busy in its slot. On a small host that round trip is most of what
the gateway adds to a turn: redis-server and the gateway both sleep between turns, and waking each
costs far more than the script does (figures: docs/benchmarks.md, "Figures formerly in code
comments").

When this process already holds the session's lock — the previous turn's write-behind save holds
it and the next turn takes it over (gateway.turn.hold) — everything the engine call depends on is
known here without asking: the lock is certainly ours for a while yet (`SessionHold.valid_until`),
under it nothing else moves the session, and the record this process last wrote says which slot
holds it. Then the engine call starts at once, beside the opening read, and what it answers is
passed on only once the read confirms what it was started on: the lock kept, the session marked
busy in that very slot of that model, the request admitted (`Turn.early`). Otherwise the call is
abandoned — its connection is closed, so the engine stops — and the turn goes on exactly as if it
had not been made.

Two things are not under the session's lock, and both are fenced:
- the node agent drops a dead engine's sessions from the index, and the restarted engine's slots
  hold nothing of them — or, once placed again, someone else's session. So the early call names
  the engine process it was meant for (`X-Slotkeeper-Instance`: the instance id its node gave
  that process and registered) and any later process refuses it with 409 before it reaches a slot
  (engine_pool.server.app); a refused call is made again as the turn's ordinary call.
- admission: a request the opening read refuses (its rate, its in-flight places) must not be
  answered, and its early call is abandoned then — but the engine may have begun it. So the early
  start is taken only while this process's last opening reads of the tenant left room
  (`Admission`): a tenant at its limits pays the round trip, and one that ran past them is caught
  by the refusal, after which it gets no early start until its window turns.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from engine_pool.errors import INSTANCE_HEADER, ApiError, InstanceChanged
from gateway.cluster import EngineRef
from gateway.turn.hold import Phase, SessionHold

T = TypeVar("T")


@dataclass(frozen=True)
class EarlyStart:
    """Where an early call goes: the slot the session is live in, on the engine process that holds it."""

    engine: str
    slot: int
    url: str  # the engine's base URL
    instance: str

    def headers(self) -> dict[str, str]:
        return {INSTANCE_HEADER: self.instance}


def early_start(
    hold: SessionHold | None, engine: EngineRef | None, model: str, now: float, *, margin_s: float
) -> EarlyStart | None:
    """Where to send a turn before its opening read, or None to wait for the read.

    ``hold`` is this process's hold on the session, just taken over for this turn (RUNNING with the
    previous turn's bookkeeping written); ``engine`` the cached registry's entry for the engine the
    hold's record names; ``now`` is ``time.monotonic()``; the lock must stay certainly held for
    ``margin_s`` more (far longer than the opening read takes)."""
    if hold is None or hold.phase is not Phase.RUNNING or hold.released.done() or not hold.booked.is_set():
        return None
    if hold.valid_until - now < margin_s:
        return None
    rec = hold.record
    place = rec.place if rec is not None else None
    if rec is None or place is None:
        return None
    engine_id, slot = place
    if rec.model != model or engine is None or engine.engine != engine_id or engine.model != model:
        return None
    if not engine.instance or not engine.url or not 0 <= slot < engine.n_slots:
        return None
    return EarlyStart(engine_id, slot, engine.url, engine.instance)


def fenced(exc: BaseException) -> bool:
    """The engine refused the call as meant for another of its processes (it restarted)."""
    return isinstance(exc, ApiError) and exc.status == 409 and exc.code == InstanceChanged.code


class EarlyCall(Generic[T]):
    """An engine call started early: awaited once the turn confirmed it, else discarded. ``close``
    releases what a call that completed holds (an opened stream) when nobody will read it."""

    def __init__(self, call: Awaitable[T], close: Callable[[T], None] | None = None) -> None:
        self._task: asyncio.Future[T] = asyncio.ensure_future(call)
        self._close = close
        self._discarded = False
        self.started = time.perf_counter()
        self._task.add_done_callback(self._done)

    def _done(self, task: asyncio.Future[T]) -> None:
        if task.cancelled():
            return
        if task.exception() is None and self._discarded and self._close is not None:  # (retrieves it too)
            self._close(task.result())

    def discard(self) -> None:
        """Abandon it: a call in flight is cancelled (its connection closed, the engine stops)."""
        if self._discarded:
            return
        self._discarded = True
        if not self._task.done():
            self._task.cancel()
        elif not self._task.cancelled() and self._task.exception() is None and self._close is not None:
            self._close(self._task.result())

    async def result(self, again: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
        """The call's answer, or ``again()``'s when the engine refused it as meant for an earlier
        process of its own; and whether it was refused so."""
        try:
            return await self._task, False
        except ApiError as exc:
            if not fenced(exc):
                raise
        return await again(), True

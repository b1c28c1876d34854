"""Slot leases: which request (or slot operation) owns which slot, and who waits, in a bounded queue.

`SlotLeases` is the one owner of slot occupancy in the engine process. Every decode request and
every save/restore/erase takes a lease on one slot before touching the core and gives it back when
the core is done with the slot, so the core never queues anything itself: a request without
`id_slot` gets a slot chosen here (`choose_slot`, the core's rule: the idle slot with the longest
common prefix, else the least recently used), a request for a busy slot waits in the queue, and a
slot operation waits (bounded) until the slot is idle. Waiters beyond `queue_size` are refused
with 503 + Retry-After.

Slot contents are known exactly because they only change under a lease: when a lease ends, the
slot's tokens are read back from the core (`fetch_tokens`) before the slot counts as free again.
All methods run on the event loop; nothing here blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import structlog

from engine_pool.errors import SlotBusy, Unavailable

log = structlog.get_logger("engine.slot_leases")


@dataclass(frozen=True)
class SlotView:
    """What slot choice needs to know about one slot."""

    id: int
    free: bool
    tokens: Sequence[int]
    last_used: float
    prompt_n: int = 0  # the last prompt it served (0: unknown)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def choose_slot(slots: Sequence[SlotView], prompt: Sequence[int], turn_slack: int = 0) -> int | None:
    """The free slot with the longest common prefix with `prompt`, else the least recently used.

    Like the core and llama-server's --slot-prompt-similarity 0.1, a prefix shorter than a tenth of
    the prompt (or than 2 tokens: a shared BOS) does not count. Unlike llama-server, a prompt that
    only shares a prefix with that slot's conversation (it leaves the slot's last prompt before its
    end: a new conversation with the same system prompt) goes to an empty slot when there is one,
    which starts from the other slot's state (the request's prefix sources) and leaves that
    conversation where it is. A turn that continues the conversation leaves it at most
    `turn_slack` tokens before that end (the template's generation prompt, which the next turn
    renders as the reply). None when no slot is free.
    """
    min_prefix = max(2, len(prompt) // 10)
    best: tuple[int, float, int] | None = None  # (-prefix, last_used, id): smallest wins
    leaves = False  # the best slot holds another conversation the prompt only shares a prefix with
    for s in slots:
        if not s.free:
            continue
        p = common_prefix(s.tokens, prompt)
        key = (-(p if p >= min_prefix else 0), s.last_used, s.id)
        if best is None or key < best:
            best = key
            leaves = p >= min_prefix and s.prompt_n > 0 and p < s.prompt_n - turn_slack
    if best is not None and leaves:
        # Keep that conversation: an empty slot starts from its prefix instead (prefix_sources).
        empty = [(s.last_used, s.id) for s in slots if s.free and not s.tokens]
        if empty:
            return min(empty)[1]
    return None if best is None else best[2]


@dataclass
class _Slot:
    id: int
    state: str = "free"  # free | busy | refreshing
    tokens: list[int] = field(default_factory=list)
    last_used: float = 0.0
    purpose: str = ""
    prompt_n: int = 0  # the prompt of its last request (0: unknown, e.g. after a restore)
    label: tuple[str, str] | None = None  # (owner, session) its last request ran for, if it said


@dataclass
class _Waiter:
    slot: int  # -1: any slot
    prompt: Sequence[int]
    purpose: str
    future: asyncio.Future[int]


class SlotLeases:
    """Leases on the engine's slots; see the module docstring."""

    def __init__(
        self,
        n_slots: int,
        queue_size: int,
        retry_after_s: int,
        fetch_tokens: Callable[[int], Awaitable[list[int]]],
    ) -> None:
        self._slots = [_Slot(i) for i in range(n_slots)]
        self._waiters: deque[_Waiter] = deque()
        self._queue_size = queue_size
        self._retry_after = retry_after_s
        self._fetch = fetch_tokens
        self._refreshing: set[asyncio.Task[None]] = set()
        self._closed = False
        # Tokens of the chat template's generation prompt (set once the template is known).
        self.turn_slack = 0

    # -- leases ---------------------------------------------------------------------------------
    async def acquire(
        self,
        slot: int = -1,
        prompt: Sequence[int] = (),
        *,
        purpose: str = "request",
        wait_s: float | None = None,
    ) -> int:
        """Wait for a lease on `slot` (-1: the best free slot for `prompt`) and return the slot id.

        Without `wait_s` (decode requests), raises Unavailable (503) when the request would wait
        and `queue_size` requests already do; with it (slot operations), raises SlotBusy (409) when
        `wait_s` passes before the slot is free.
        """
        if self._closed:
            raise Unavailable("the engine is shutting down", retry_after=self._retry_after)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(slot, prompt, purpose, fut)
        self._waiters.append(waiter)
        self._dispatch()
        if fut.done():
            return fut.result()
        # Requests are bounded by the queue; slot operations (which pass wait_s) by their wait instead,
        # so that a busy engine can still be drained of its sessions.
        queued = sum(1 for w in self._waiters if w.purpose == "request")
        if wait_s is None and queued - 1 >= self._queue_size and not self._imminent(slot):
            self._waiters.remove(waiter)
            which = f"slot {slot} is" if slot >= 0 else f"all {len(self._slots)} slots are"
            raise Unavailable(
                f"{which} busy and the queue is full ({self._queue_size} waiting); retry later",
                retry_after=self._retry_after,
            )
        try:
            done, _ = await asyncio.wait({fut}, timeout=wait_s)
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise
        if not done:
            self._abandon(waiter)
            raise SlotBusy(
                f"slot {slot} is still busy after {wait_s:g} s; retry later", retry_after=self._retry_after
            )
        return fut.result()

    def _abandon(self, waiter: _Waiter) -> None:
        fut = waiter.future
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            self.release(fut.result())  # granted while the caller was leaving
        else:
            fut.cancel()
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def release(self, slot: int) -> None:
        """End a lease. The slot is free again once its tokens have been read back from the core."""
        s = self._slots[slot]
        s.state = "refreshing"
        s.last_used = time.monotonic()
        task = asyncio.get_running_loop().create_task(self._refresh(s))
        self._refreshing.add(task)
        task.add_done_callback(self._refreshing.discard)

    async def _refresh(self, s: _Slot) -> None:
        try:
            s.tokens = list(await self._fetch(s.id))
        except Exception as exc:  # the core is closing: the slot's contents no longer matter
            log.warning("slot.refresh_failed", slot=s.id, error=str(exc))
            s.tokens = []
        s.state = "free"
        s.purpose = ""
        self._dispatch()

    def _imminent(self, slot: int) -> bool:
        """A slot the waiter can use is only being read back: it will be free within a loop step."""
        if slot >= 0:
            return self._slots[slot].state == "refreshing"
        return any(s.state == "refreshing" for s in self._slots)

    def _dispatch(self) -> None:
        for w in list(self._waiters):
            if w.future.done():
                self._waiters.remove(w)
                continue
            if w.slot >= 0:
                target: int | None = w.slot if self._slots[w.slot].state == "free" else None
            elif any(s.state == "refreshing" for s in self._slots):
                # A slot whose contents are being read back may be the best match: choosing among
                # the others now could put the next turn of a session on a cold slot.
                target = None
            else:
                views = [
                    SlotView(s.id, s.state == "free", s.tokens, s.last_used, s.prompt_n) for s in self._slots
                ]
                target = choose_slot(views, w.prompt, self.turn_slack)
            if target is None:
                continue
            self._waiters.remove(w)
            self._slots[target].state = "busy"
            self._slots[target].purpose = w.purpose
            if w.purpose != "save":  # (a save leaves the slot as it was)
                self._slots[target].prompt_n = len(w.prompt) if w.purpose == "request" else 0
            w.future.set_result(target)

    # -- views ----------------------------------------------------------------------------------
    def busy(self, slot: int) -> bool:
        return self._slots[slot].state != "free"

    def n_busy(self) -> int:
        return sum(1 for s in self._slots if s.state != "free")

    def n_waiting(self) -> int:
        return len(self._waiters)

    def waiting_for(self, slot: int) -> int:
        return sum(1 for w in self._waiters if w.slot == slot)

    def purpose(self, slot: int) -> str:
        return self._slots[slot].purpose

    def set_tokens(self, slot: int, tokens: list[int]) -> None:
        """Known contents of a leased slot (e.g. right after a restore), for logging and views."""
        self._slots[slot].tokens = tokens

    def n_tokens(self, slot: int) -> int:
        return len(self._slots[slot].tokens)

    def label(self, slot: int, owner: str = "", session: str = "") -> None:
        """Whose state the slot holds now: the (owner, session) a request ran for, or nobody's that
        anyone named (a request without them, a restore, an erase). The gateway reads it back from
        ``GET /slots`` when it rebuilds a lost index."""
        self._slots[slot].label = (owner, session) if owner and session else None

    def label_of(self, slot: int) -> tuple[str, str] | None:
        return self._slots[slot].label

    def close(self) -> None:
        """Refuse new leases and fail every waiter (the engine is shutting down)."""
        self._closed = True
        for w in self._waiters:
            if not w.future.done():
                w.future.set_exception(
                    Unavailable("the engine is shutting down", retry_after=self._retry_after)
                )
        self._waiters.clear()
        for task in list(self._refreshing):
            task.cancel()

"""Where a request runs: a pure decision over a pool view of the engines and the session.

`choose_placement` takes plain data and returns a `Placement`; the gateway's request path carries
it out (spill the evicted session, fill the session into the slot, forward the request).
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass, replace
from enum import StrEnum

from gateway.cluster import EngineView, SlotView


class Serve(StrEnum):
    LIVE = "live"  # the session is in this slot already
    RESTORE = "restored"  # fill the slot from the session's newest durable generation
    COLD = "cold"  # a new (or never saved) session: the prompt is evaluated in full


@dataclass(frozen=True)
class SessionView:
    tenant: str
    session: str
    engine: str | None = None  # where it is live, if it is
    slot: int | None = None
    generation: int = 0  # newest durable generation (0 = none)


@dataclass(frozen=True)
class Placement:
    engine: str
    slot: int
    serve: Serve
    evict: SlotView | None = None  # an idle session to spill out of the slot first
    prefix_slots: tuple[int, ...] = ()  # slots of the engine the prompt may start from (same tenant)
    prefix_from: str | None = None  # the session whose state it starts from: live on the engine,
    prefix_stored: bool = False  # or (True) its stored prefix, filled into the slot
    handed_off: bool = False  # its prompt prefilled on a prefill engine, the state installed here


def prefix_slots(engine: EngineView, tenant: str, slot: int) -> tuple[int, ...]:
    """The engine's slots (other than `slot`) holding the tenant's sessions: a prompt sharing a
    prefix with one of them may start from its state. Never another tenant's."""
    return tuple(
        s.slot for s in engine.slots if s.tenant == tenant and s.session is not None and s.slot != slot
    )


def reserved(engines: list[EngineView], taken: Set[tuple[str, int]]) -> list[EngineView]:
    """The pool view with the `(engine, slot)`s another placement has just chosen shown busy: that
    placement is evicting into, filling or erasing them, and the index does not show it yet."""
    if not taken:
        return engines
    return [
        replace(e, slots=tuple(replace(s, busy=True) if (e.engine, s.slot) in taken else s for s in e.slots))
        for e in engines
    ]


class NoCapacity(Exception):
    """Every slot of every ready engine serving the model is busy."""


class LiveSlotsExhausted(Exception):
    """The tenant holds its whole live-slot quota and every one of those sessions is busy."""


def choose_placement(
    engines: list[EngineView],
    model: str,
    session: SessionView,
    live_limit: int | None = None,
    prefer: str | None = None,
) -> Placement:
    """Live → its own slot. Otherwise a free slot of a ready engine with the model (the engine with
    most free slots first), else the least recently used idle slot there, whose session is evicted.
    Busy slots are never evicted. Raises NoCapacity when nothing is idle.

    `prefer`: an engine holding the state the session would start from (its shared prefix, a
    parent it forks): a free slot there before any other; with no free slot anywhere, its least
    recently used idle slot is the victim — the state copied on the engine saves a prefill, and
    nobody is evicted for it who would not be anyway.

    `live_limit` is the tenant's live-slot quota, counted after the placement whoever is evicted:
    a tenant already holding that many slots makes room by evicting its OWN least recently used idle
    session (LiveSlotsExhausted when all of them are busy), never by taking one more slot."""
    candidates = [e for e in engines if e.ready and e.model == model]
    for e in candidates:
        if e.engine != session.engine:
            continue
        for s in e.slots:
            if s.slot == session.slot and (s.tenant, s.session) == (session.tenant, session.session):
                if s.busy:
                    break  # the caller forks a busy session; never wait here
                return Placement(e.engine, s.slot, Serve.LIVE)
    serve = Serve.RESTORE if session.generation > 0 else Serve.COLD
    if live_limit is not None:
        own = [
            (s.last_used, e.engine, s)
            for e in candidates
            for s in e.slots
            if s.tenant == session.tenant and s.session is not None and s.session != session.session
        ]
        if len(own) >= live_limit:
            idle_own = [t for t in own if not t[2].busy]
            if not idle_own:
                raise LiveSlotsExhausted(f"tenant {session.tenant} uses all of its {live_limit} live slots")
            _, engine, victim = min(idle_own, key=lambda t: (t[0], t[1], t[2].slot))
            return Placement(engine, victim.slot, serve, evict=victim)

    def free(e: EngineView) -> list[SlotView]:
        return [s for s in e.slots if not s.busy and s.session is None]

    preferred = next((e for e in candidates if e.engine == prefer), None)
    if preferred is not None and free(preferred):
        return Placement(preferred.engine, free(preferred)[0].slot, serve)
    with_free = sorted((e for e in candidates if free(e)), key=lambda e: (-len(free(e)), e.engine))
    if with_free:
        return Placement(with_free[0].engine, free(with_free[0])[0].slot, serve)
    # Nothing free: someone is evicted anyway; there, the preferred engine's LRU idle session. One
    # whose last turn is still being saved is evicted only after that save: the others go first.
    idle = [(s.saving, s.last_used, e.engine, s) for e in candidates for s in e.slots if not s.busy]
    idle_there = [t for t in idle if t[2] == prefer]
    if idle_there:
        idle = idle_there
    if not idle:
        raise NoCapacity(f"all slots for model {model!r} are busy")
    *_, engine, victim = min(idle, key=lambda t: (t[0], t[1], t[2], t[3].slot))
    return Placement(engine, victim.slot, serve, evict=victim)

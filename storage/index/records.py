"""Session records as the index stores them: one Redis hash per (tenant, session).

A record is plain data; :class:`storage.index.session_index.SessionIndex` decides transitions as pure
functions over it and writes it back in one transaction. Which state may follow which is one table,
`TRANSITIONS` (None: no record), and `checked` is the one function every write goes through: it
refuses anything else with :class:`IllegalTransition` (a bug in a decision, not a runtime
condition). Callers ask a record what it is through its predicates (`live`, `place`, `live_in`,
`stored`), never by comparing its state.

| from \\ to | new | live | spilled |
|---|---|---|---|
| (none) | created | healing adopts a labelled slot | reindex adopts a stored generation |
| new | touched | placed in a slot | reindex adopts a stored generation |
| live | its engine died, nothing saved | a turn, a move, a save | evicted, drained, its engine died |
| spilled | — | restored into a slot | a newer stored generation |
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any

from storage.errors import IllegalTransition
from storage.index.keyspace import text_map
from storage.index.prefix_digests import join_routes


class SessionState(StrEnum):
    NEW = "new"  # known, nothing saved yet
    LIVE = "live"  # in an engine slot (busy, or idle in the engine's LRU)
    SPILLED = "spilled"  # only in the spill cache / blob store, at ``generation``


# Which state may follow which (None: no record yet). Deleting a record is always allowed.
TRANSITIONS: Mapping[SessionState | None, frozenset[SessionState]] = {
    None: frozenset({SessionState.NEW, SessionState.LIVE, SessionState.SPILLED}),
    SessionState.NEW: frozenset({SessionState.NEW, SessionState.LIVE, SessionState.SPILLED}),
    SessionState.LIVE: frozenset({SessionState.NEW, SessionState.LIVE, SessionState.SPILLED}),
    SessionState.SPILLED: frozenset({SessionState.LIVE, SessionState.SPILLED}),
}


@dataclass(frozen=True)
class SessionRecord:
    tenant: str
    session: str
    state: SessionState
    model: str = ""
    tokens: int = 0
    engine: str | None = None
    slot: int | None = None
    generation: int = 0  # newest durable generation; 0 = none
    blob_key: str = ""
    bytes: int = 0
    last_used: float = 0.0
    route: str = ""  # newest routing digest: stored with the slot file, so reindex restores it
    shared: str = ""  # its shared prefix's digest (storage.index.shared_prefixes): stored beside the route
    prompt: str = ""  # its last prompt's digest (storage.index.shared_prefixes): stored beside the route
    # Its last turn's head (gateway.turn.prompt.head_digest): a turn continues the session only from
    # there, else it branches (gateway.turn.branch). Stored beside the route.
    head: str = ""
    dirty: bool = False  # the slot changed since durable `generation` was saved
    # Generations up to `floor` belonged to an earlier, deleted session with this id: copies of them
    # may linger in spill caches or the store, so this session never saves or records one of them.
    floor: int = 0
    reserved: int = 0  # the highest generation handed out by SessionIndex.reserve_generation

    @property
    def stored_routes(self) -> str:
        """What a save stores for reindex to route to the session again
        (:func:`storage.index.prefix_digests.join_routes`)."""
        return join_routes(self.route, self.shared, self.prompt, self.head)

    @property
    def live(self) -> bool:
        """In an engine slot now."""
        return self.state is SessionState.LIVE and self.engine is not None and self.slot is not None

    @property
    def place(self) -> tuple[str, int] | None:
        """(engine, slot) it is live in now, else None."""
        return (
            (self.engine, self.slot)
            if self.engine is not None and self.slot is not None and self.live
            else None
        )

    def live_in(self, engine: str | None, slot: int | None = None) -> bool:
        """In a slot of ``engine`` now (``slot``: that very slot)."""
        return self.live and self.engine == engine and (slot is None or self.slot == slot)

    @property
    def stored(self) -> bool:
        """Only in the store (and spill caches), at its durable generation."""
        return self.state is SessionState.SPILLED

    @property
    def next_generation(self) -> int:
        """The lowest generation the next save may use: above the durable one, every one handed
        out already, and every one an earlier namesake used."""
        return max(self.generation, self.floor, self.reserved) + 1

    @property
    def used_generations(self) -> int:
        """The highest generation this session may have written anywhere (its tombstone)."""
        return max(self.generation, self.floor, self.reserved)

    def to_hash(self) -> dict[str, str]:
        out = {name: str(getattr(self, name)) for name in _HASH_FIELDS}  # (asdict deep-copies: slower)
        out["engine"] = self.engine or ""
        out["slot"] = "" if self.slot is None else str(self.slot)
        return out

    @classmethod
    def from_hash(cls, tenant: str, session: str, raw: Mapping[Any, Any]) -> SessionRecord:
        h = text_map(dict(raw))
        return cls(
            tenant=tenant,
            session=session,
            state=SessionState(h["state"]),
            model=h.get("model", ""),
            tokens=int(h.get("tokens", 0)),
            engine=h.get("engine") or None,
            slot=int(h["slot"]) if h.get("slot") else None,
            generation=int(h.get("generation", 0)),
            blob_key=h.get("blob_key", ""),
            bytes=int(h.get("bytes", 0)),
            last_used=float(h.get("last_used", 0)),
            route=h.get("route", ""),
            shared=h.get("shared", ""),
            prompt=h.get("prompt", ""),
            head=h.get("head", ""),
            dirty=h.get("dirty") == "True",
            floor=int(h.get("floor", 0)),
            reserved=int(h.get("reserved", 0)),
        )


_HASH_FIELDS = tuple(f.name for f in fields(SessionRecord) if f.name not in ("tenant", "session"))


def checked(old: SessionRecord | None, new: SessionRecord | None) -> SessionRecord | None:
    """``new`` as the record that follows ``old`` (None: no record), or :class:`IllegalTransition`
    naming both states when `TRANSITIONS` does not allow it. Deleting (``new`` None) always is."""
    if new is not None and new.state not in TRANSITIONS[old.state if old is not None else None]:
        before = old.state.value if old is not None else "no record"
        raise IllegalTransition(f"session {new.session}: {before} -> {new.state.value} is not a transition")
    return new

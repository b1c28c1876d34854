"""gateway.turn.place's pure decisions, without processes: which slots and which session a placed
prompt may start from (`refine`), and how the chosen slot is made ready (`slot_prep`)."""

from __future__ import annotations

from gateway.cluster import EngineView, SlotView
from gateway.turn.place import SlotPrep, refine, slot_prep
from gateway.turn.slot_choice import Placement, Serve
from storage.index.records import SessionRecord, SessionState


def _rec(
    session: str, *, engine: str | None = None, slot: int | None = None, generation: int = 0
) -> SessionRecord:
    state = SessionState.LIVE if engine else (SessionState.SPILLED if generation else SessionState.NEW)
    return SessionRecord("t", session, state, "m", engine=engine, slot=slot, generation=generation)


ENGINE = EngineView(
    "e1",
    "m",
    True,
    (SlotView(0, tenant="t", session="parent"), SlotView(1), SlotView(2, tenant="u", session="other")),
)


def test_a_placement_may_start_from_the_tenants_own_slots_only_while_its_sessions_share() -> None:
    placed = refine(Placement("e1", 1, Serve.COLD), ENGINE, "t", None, forked=False, shares=True)
    assert (placed.prefix_slots, placed.prefix_from) == ((0,), None)  # never another tenant's slot 2
    alone = refine(Placement("e1", 1, Serve.COLD), ENGINE, "t", None, forked=False, shares=False)
    assert alone.prefix_slots == ()


def test_a_fork_of_a_parent_live_on_the_engine_starts_cold_from_the_parents_slot() -> None:
    parent = _rec("parent", engine="e1", slot=0, generation=2)
    placed = refine(Placement("e1", 1, Serve.RESTORE), ENGINE, "t", parent, forked=True, shares=False)
    assert (placed.serve, placed.prefix_slots, placed.prefix_from) == (Serve.COLD, (0,), "parent")
    elsewhere = refine(Placement("e2", 0, Serve.RESTORE), ENGINE, "t", parent, forked=True, shares=False)
    assert (elsewhere.serve, elsewhere.prefix_from) == (Serve.RESTORE, None)  # restored from its file


def test_how_a_slot_is_made_ready() -> None:
    restore = slot_prep(Placement("e1", 1, Serve.RESTORE), "t", "s", 4, None, True, None, True)
    assert restore == SlotPrep(fill="s", generation=4, tokens=True)
    assert slot_prep(Placement("e1", 1, Serve.LIVE), "t", "s", 4, None, False, None, True) == SlotPrep()
    # cold, another tenant's session evicted from the slot: cleared
    evicted = Placement("e1", 2, Serve.COLD, evict=SlotView(2, tenant="u", session="other"))
    assert slot_prep(evicted, "t", "s", 0, None, False, None, True) == SlotPrep(erase=True)
    # cold, the tenant's own session evicted from it: kept, the engine may start from it
    own = Placement("e1", 0, Serve.COLD, evict=SlotView(0, tenant="t", session="parent"))
    assert slot_prep(own, "t", "s", 0, None, False, None, True) == SlotPrep(erase=False)


def test_a_cold_slot_is_filled_with_the_stored_prefix_of_a_holder_live_elsewhere() -> None:
    from gateway.turn.prompt import Prompt

    prompt = Prompt([{"role": "user", "content": "hi"}], "m", {})
    holder = _rec("holder", engine="e2", slot=0, generation=3)
    prep = slot_prep(Placement("e1", 1, Serve.COLD), "t", "s", 0, holder, False, prompt, True)
    assert prep == SlotPrep(fill="holder", generation=3, tokens=True, prefix=True, erase=True)
    here = _rec("holder", engine="e1", slot=0, generation=3)  # live on this engine: its slot serves
    assert slot_prep(Placement("e1", 1, Serve.COLD), "t", "s", 0, here, False, prompt, True) == SlotPrep(
        erase=True
    )

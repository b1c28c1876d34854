"""The pure placement decision."""

from __future__ import annotations

import pytest

from gateway.cluster import EngineView, SlotView
from gateway.turn.slot_choice import (
    LiveSlotsExhausted,
    NoCapacity,
    Serve,
    SessionView,
    choose_placement,
    prefix_slots,
    reserved,
)


def _engine(name: str, *slots: SlotView, model: str = "m", ready: bool = True) -> EngineView:
    return EngineView(name, model, ready, tuple(slots))


def test_live_session_goes_to_its_slot():
    engines = [_engine("e1", SlotView(0), SlotView(1, tenant="t", session="s", last_used=5))]
    p = choose_placement(engines, "m", SessionView("t", "s", engine="e1", slot=1, generation=3))
    assert (p.engine, p.slot, p.serve, p.evict) == ("e1", 1, Serve.LIVE, None)


def test_spilled_session_restores_into_a_free_slot_on_the_least_loaded_engine():
    engines = [
        _engine("e1", SlotView(0, tenant="t", session="x"), SlotView(1)),
        _engine("e2", SlotView(0), SlotView(1)),
        _engine("e3", SlotView(0), SlotView(1), model="other"),
    ]
    p = choose_placement(engines, "m", SessionView("t", "s", generation=2))
    assert (p.engine, p.serve, p.evict) == ("e2", Serve.RESTORE, None)


def test_full_engines_evict_the_least_recently_used_idle_session_never_a_busy_one():
    engines = [
        _engine(
            "e1",
            SlotView(0, busy=True, tenant="t", session="a", last_used=1),
            SlotView(1, tenant="t", session="b", last_used=9),
        ),
        _engine("e2", SlotView(0, tenant="u", session="c", last_used=4)),
    ]
    p = choose_placement(engines, "m", SessionView("t", "new"))
    assert (p.engine, p.slot, p.serve) == ("e2", 0, Serve.COLD)
    assert p.evict is not None and p.evict.session == "c"


def test_busy_live_session_is_placed_elsewhere_and_nothing_idle_means_no_capacity():
    engines = [_engine("e1", SlotView(0, busy=True, tenant="t", session="s")), _engine("e2", SlotView(0))]
    p = choose_placement(engines, "m", SessionView("t", "s", engine="e1", slot=0, generation=1))
    assert (p.engine, p.serve) == ("e2", Serve.RESTORE)
    with pytest.raises(NoCapacity):
        choose_placement([_engine("e1", SlotView(0, busy=True))], "m", SessionView("t", "s"))


def test_engines_not_ready_are_skipped():
    engines = [_engine("e1", SlotView(0), ready=False)]
    with pytest.raises(NoCapacity):
        choose_placement(engines, "m", SessionView("t", "s"))


def test_a_tenant_at_its_live_slot_quota_makes_room_by_evicting_its_own_idle_session():
    engines = [
        _engine(
            "e1",
            SlotView(0),  # free: but taking it would be a third live slot for t
            SlotView(1, tenant="t", session="a", last_used=5),
            SlotView(2, tenant="t", session="b", last_used=3),
            SlotView(3, tenant="u", session="c", last_used=1),
        )
    ]
    p = choose_placement(engines, "m", SessionView("t", "new"), live_limit=2)
    assert (p.slot, p.evict and p.evict.session) == (2, "b")
    # Under the quota: the usual rule (a free slot), whoever else is there.
    assert choose_placement(engines, "m", SessionView("t", "new"), live_limit=3).slot == 0
    # The session itself does not count against its own placement.
    assert choose_placement(engines, "m", SessionView("t", "a", generation=1), live_limit=2).slot == 0


def test_a_tenant_whose_live_slots_are_all_busy_is_refused():
    engines = [_engine("e1", SlotView(0), SlotView(1, busy=True, tenant="t", session="a"))]
    with pytest.raises(LiveSlotsExhausted):
        choose_placement(engines, "m", SessionView("t", "new"), live_limit=1)


def test_slots_another_placement_just_chose_are_busy():
    engines = [_engine("e1", SlotView(0), SlotView(1, tenant="t", session="old", last_used=1))]
    taken = reserved(engines, {("e1", 0)})
    p = choose_placement(taken, "m", SessionView("u", "new"))
    assert (p.slot, p.evict and p.evict.session) == (1, "old")
    with pytest.raises(NoCapacity):
        choose_placement(reserved(engines, {("e1", 0), ("e1", 1)}), "m", SessionView("u", "new"))
    assert reserved(engines, set()) is engines


def test_a_session_prefers_the_engine_holding_its_prefix_free_slot_then_lru_idle():
    holder = SlotView(0, tenant="t", session="x", last_used=9)
    engines = [
        _engine("e1", SlotView(0), SlotView(1), SlotView(2)),  # most free slots
        _engine("e2", holder, SlotView(1)),
    ]
    new = SessionView("t", "s")
    assert choose_placement(engines, "m", new).engine == "e1"
    p = choose_placement(engines, "m", new, prefer="e2")
    assert (p.engine, p.slot, p.serve, p.evict) == ("e2", 1, Serve.COLD, None)
    full = [engines[0], _engine("e2", holder, SlotView(1, tenant="u", session="y", last_used=3))]
    assert choose_placement(full, "m", new, prefer="e2").engine == "e1"  # free elsewhere: nobody evicted
    older = _engine("e1", SlotView(0, tenant="u", session="z", last_used=1))
    p = choose_placement([older, full[1]], "m", new, prefer="e2")  # all full: the victim is e2's LRU
    assert (p.engine, p.slot) == ("e2", 1) and p.evict is not None and p.evict.session == "y"
    assert choose_placement([older, full[1]], "m", new).evict.session == "z"  # type: ignore[union-attr]
    busy = [older, _engine("e2", SlotView(0, busy=True, tenant="t", session="x"))]
    assert choose_placement(busy, "m", new, prefer="e2").engine == "e1"  # nothing idle there
    assert choose_placement(engines, "m", new, prefer="gone").engine == "e1"


def test_prefix_slots_are_the_tenants_own_only():
    e = _engine(
        "e",
        SlotView(0, tenant="t", session="a"),
        SlotView(1, tenant="u", session="b"),
        SlotView(2),
        SlotView(3, tenant="t", session="c", busy=True),
    )
    assert prefix_slots(e, "t", 2) == (0, 3)  # busy ones too: the engine copies them as they stand
    assert prefix_slots(e, "t", 0) == (3,)
    assert prefix_slots(e, "u", 2) == (1,)
    assert prefix_slots(e, "nobody", 2) == ()


def test_an_idle_session_still_saving_its_last_turn_is_evicted_last():
    engines = [
        _engine(
            "e",
            SlotView(0, tenant="t", session="a", last_used=1, saving=True),
            SlotView(1, tenant="t", session="b", last_used=5),
        )
    ]
    p = choose_placement(engines, "m", SessionView("t", "new"))
    assert p.evict is not None and p.evict.session == "b"  # not the older one: its save is running
    both = [
        _engine(
            "e",
            SlotView(0, tenant="t", session="a", last_used=1, saving=True),
            SlotView(1, tenant="t", session="b", last_used=5, saving=True),
        )
    ]
    assert choose_placement(both, "m", SessionView("t", "new")).evict.session == "a"  # type: ignore[union-attr]

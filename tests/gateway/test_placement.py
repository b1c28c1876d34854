"""The pure placement decision."""

from __future__ import annotations

import pytest

from gateway.placement import (
    EngineView,
    LiveSlotsExhausted,
    NoCapacity,
    Serve,
    SessionView,
    SlotView,
    choose_placement,
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

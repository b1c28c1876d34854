"""A slot chosen by one placement stays taken for every placement that might decide from a
pool view read before the choice was recorded in the index."""

from __future__ import annotations

from gateway.turn.reservations import SlotReservations


def test_a_held_slot_is_taken_and_a_released_one_only_for_pool_views_older_than_its_release() -> None:
    r = SlotReservations()
    early = r.start_pool_view()  # a placement reading the index before the record below is written
    mine = r.start_pool_view()
    r.hold(("e1", 4))
    r.end_pool_view(mine)
    assert r.taken(early) == {("e1", 4)}
    r.release(("e1", 4))  # mark_live done: the index shows it from now on
    assert r.taken(early) == {("e1", 4)}  # but `early` may have read the index before that
    late = r.start_pool_view()
    assert r.taken(late) == set()  # read after the record: the index says it
    r.end_pool_view(early)
    r.end_pool_view(late)
    assert r.taken(r.start_pool_view()) == set() and not r._released  # forgotten once nobody can need it


def test_a_slot_two_placements_hold_stays_taken_until_both_release_it() -> None:
    # A turn on its live slot holds it (no pool view) while another placement holds it to evict
    # that session; the turn fails and releases first: the evicting placement still holds it.
    r = SlotReservations()
    r.hold(("e1", 1))  # the eviction's choice
    r.hold(("e1", 1))  # the live turn
    r.release(("e1", 1))
    later = r.start_pool_view()
    assert r.taken(later) == {("e1", 1)}  # else a third placement would fill it beside the first
    r.release(("e1", 1))
    r.end_pool_view(later)
    assert r.taken(r.start_pool_view()) == set()


def test_releasing_an_unknown_slot_is_harmless() -> None:
    r = SlotReservations()
    r.release(("e1", 0))
    assert r.taken(r.start_pool_view()) == set()

"""gateway.turn.evict's pure decision: what evicting a session from a slot takes."""

from __future__ import annotations

from gateway.turn.evict import EvictionStep, eviction_step
from storage.index.records import SessionRecord, SessionState


def _live(**kw) -> SessionRecord:
    return SessionRecord("t", "s", SessionState.LIVE, "m", engine="e1", slot=3, **kw)


def test_what_evicting_a_session_takes() -> None:
    assert eviction_step(_live(), "e1", 3) is EvictionStep.SAVE  # never saved
    assert eviction_step(_live(generation=2, dirty=True), "e1", 3) is EvictionStep.SAVE
    assert eviction_step(_live(generation=2), "e1", 3) is EvictionStep.RECORD  # its save is current
    # it moved while we waited for its lock: the slot is no longer its own to save
    assert eviction_step(_live(generation=2), "e1", 4) is EvictionStep.MOVED
    assert eviction_step(_live(generation=2), "e2", 3) is EvictionStep.MOVED
    spilled = SessionRecord("t", "s", SessionState.SPILLED, "m", generation=2)
    assert eviction_step(spilled, "e1", 3) is EvictionStep.MOVED

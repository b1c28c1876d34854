"""storage.index.records: the one table of session states and the predicates callers read."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from storage.errors import IllegalTransition
from storage.index.records import TRANSITIONS, SessionRecord, SessionState, checked
from storage.index.session_index import SessionIndex

NEW = SessionRecord("t", "s", SessionState.NEW)
LIVE = SessionRecord("t", "s", SessionState.LIVE, engine="e1", slot=2)
SPILLED = SessionRecord("t", "s", SessionState.SPILLED, generation=3)


@pytest.fixture
def index(redis_client: Any) -> SessionIndex:
    return SessionIndex(redis_client)


def test_every_write_goes_through_the_table() -> None:
    for old in (None, NEW, LIVE, SPILLED):
        for new in (NEW, LIVE, SPILLED):
            allowed = new.state in TRANSITIONS[old.state if old is not None else None]
            if allowed:
                assert checked(old, new) is new
            else:
                with pytest.raises(IllegalTransition, match="spilled -> new"):
                    checked(old, new)
        assert checked(old, None) is None  # deleting always is
    # Stored state never becomes "nothing saved" again: that would lose its generation.
    assert SessionState.NEW not in TRANSITIONS[SessionState.SPILLED]


async def test_the_index_refuses_an_illegal_decision_and_writes_nothing(index: SessionIndex) -> None:
    await index.create("t", "s", model="m")
    await index.transition("t", "s", lambda old: replace(old, state=SessionState.SPILLED, generation=1))
    with pytest.raises(IllegalTransition):
        await index.transition("t", "s", lambda old: replace(old, state=SessionState.NEW))
    assert (await index.get("t", "s")).state is SessionState.SPILLED


def test_callers_read_predicates_not_states() -> None:
    assert LIVE.live and LIVE.place == ("e1", 2) and LIVE.live_in("e1") and LIVE.live_in("e1", 2)
    assert not LIVE.live_in("e1", 1) and not LIVE.live_in("e2") and not LIVE.stored
    half = replace(LIVE, slot=None)  # live with no slot: not anywhere a turn can go
    assert not half.live and half.place is None
    for record in (NEW, SPILLED):
        assert not record.live and record.place is None and not record.live_in(None)
    assert SPILLED.stored and not NEW.stored

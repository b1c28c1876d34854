"""gateway.locking's pure decision: wait for a busy session's lock, or fork the session."""

from __future__ import annotations

import pytest

from gateway.locking import wait_or_fork
from storage.index.locks import TURN, WORK


@pytest.mark.parametrize(
    ("remaining_s", "wait_s"),
    [(30.0, None), (20.0, None), (19.9, 20.9), (0.0, 1.0), (None, 1.0)],
)
def test_a_renewed_turn_is_forked_around_and_a_lapsing_one_waited_for(remaining_s, wait_s) -> None:
    # TTL 40: a holder that renews every third keeps it above 26.7; below half (20) it died.
    assert wait_or_fork(TURN, remaining_s, 40.0, 5.0) == wait_s


@pytest.mark.parametrize("remaining_s", [40.0, 30.0, 1.0, None])
def test_the_gateways_own_work_on_a_session_is_waited_for_never_forked(remaining_s) -> None:
    """An eviction saving the session, a delete: there is no running state to fork from."""
    assert wait_or_fork(WORK, remaining_s, 40.0, 5.0) == 5.0

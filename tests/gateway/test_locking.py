"""gateway.locking's pure decision: wait for a busy session's lock, or fork the session."""

from __future__ import annotations

import pytest

from gateway.locking import wait_or_fork


@pytest.mark.parametrize(
    ("remaining_s", "wait_s"),
    [(30.0, None), (20.0, None), (19.9, 20.9), (0.0, 1.0), (None, 1.0)],
)
def test_a_renewed_lock_is_forked_around_and_a_lapsing_one_waited_for(remaining_s, wait_s) -> None:
    # TTL 40: a holder that renews every third keeps it above 26.7; below half (20) it died.
    assert wait_or_fork(remaining_s, 40.0) == wait_s

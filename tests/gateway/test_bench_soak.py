"""`slotkeeper bench soak`'s accounting: which sessions a SIGKILL could not have cost their state
(`Session.protected`), judged on plain timelines without any process. A session counted as
protected whose save a kill could in fact cut short fails the soak for nothing; one counted as
unprotected although its state was durable hides a real loss."""

from __future__ import annotations

import argparse
import random
from typing import Any

import pytest

from gateway.bench import soak as soak_bench
from gateway.bench.soak_state import Soak

GRACE_S = 10.0  # --save-grace-s: the longest write-behind save


def soak(kills: list[float]) -> Any:
    args = argparse.Namespace(save_grace_s=GRACE_S, duration_s=20.0)
    return Soak(args, "http://gw", "http://node", "tiny", "e0", "key", deadline=1e9, kills=kills)


def session(*turns: tuple[float, str]) -> Any:
    """A session with completed turns: (answer time, how it was served)."""
    s = soak_bench.Session("alpha", "alpha-s20", random.Random(0), [])
    for answered, served in turns:
        s.done_at.append(answered)
        s.waited.append(served in ("restored", "cold"))
    return s


def test_a_next_turn_served_live_does_not_end_the_save_window() -> None:
    # The soak that failed: turn 1 answered at 10.0, turn 2 sent at once and served live in its slot
    # (it does not wait for turn 1's save), answered at 10.1; the SIGKILL at 10.4 cut the save that
    # was still running. Neither turn's save is known to be over before the kill.
    s = session((10.0, "restored"), (10.1, "live"))
    assert not s.protected(soak([10.4]), before=21.0)


def test_a_next_turn_placed_anew_waited_for_the_save() -> None:
    # Turn 2 was restored: its placement waited for turn 1's save, so that save was over by 11.0.
    s = session((10.0, "live"), (11.0, "restored"))
    assert s.protected(soak([11.5]), before=21.0)
    # A kill before that answer may have cut it (the placement was waiting for it then).
    assert not s.protected(soak([10.5]), before=21.0)


def test_the_save_grace_bounds_every_save() -> None:
    s = session((1.0, "cold"), (1.2, "live"))
    assert s.protected(soak([11.5]), before=21.0)  # both saves over by 11.0 at the latest
    assert not s.protected(soak([0.5]), before=21.0)  # a kill 1 s before the answer counts
    assert not s.protected(soak([]), before=1.0)  # no turn answered before `before`


def test_a_save_the_index_showed_durable_protects() -> None:
    s = session((10.0, "restored"), (10.1, "live"))
    sk = soak([10.4])
    sk.durable[s.id] = 10.39  # the listing right before the SIGKILL showed a saved generation
    assert s.protected(sk, before=21.0)
    assert not s.protected(sk, before=10.3)  # not yet known durable then


def test_fault_kinds_are_named_or_all() -> None:
    from gateway.bench.soak_faults import FAULT_KINDS, fault_kinds

    assert fault_kinds("all") == FAULT_KINDS
    assert fault_kinds("redis, engine,redis") == ("redis", "engine")
    for bad in ("", "disk", "engine,network"):
        with pytest.raises(ValueError, match="--faults takes"):
            fault_kinds(bad)


def test_an_outage_window_protects_a_save_it_overlaps() -> None:
    sk = soak([])
    sk.faults.append(("redis", 12.0, 20.0))
    s = session((10.0, "live"))
    assert not s.protected(sk, before=40.0)  # its save may have met the outage
    sk.faults[:] = [("store", 50.0, 60.0)]
    assert s.protected(sk, before=40.0)

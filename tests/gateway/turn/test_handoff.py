"""The split decision (gateway.turn.handoff), pure: which turns are prefilled on a prefill engine,
and which one."""

from __future__ import annotations

import pytest

from engine_pool.errors import ApiError, Unavailable
from engine_pool.protocol.handoff import HandoffOutcome, HandoffRequest, parse_threshold
from gateway.cluster import EngineRef
from gateway.tenants import Tenant, TenantConfigError, parse_tenants
from gateway.turn.handoff import (
    carried_from,
    carries,
    failure,
    prefill_engine,
    split_for,
    stays_whole,
    threshold_for,
    through_store,
    uncached_tail,
)
from gateway.turn.parts import TurnSettings
from gateway.turn.slot_choice import Placement, Serve

COLD = Placement("e1", 0, Serve.COLD)
LIVE = Placement("e1", 0, Serve.LIVE)
RESTORED = Placement("e1", 0, Serve.RESTORE)


@pytest.mark.parametrize(
    ("placement", "threshold", "tokens", "split"),
    [
        (COLD, 2048, 4096, True),
        (COLD, 2048, 2048, True),
        (COLD, 2048, 2047, False),
        (COLD, 2048, None, False),  # its size unknown: left where it is
        (COLD, 0, None, True),  # always
        (COLD, None, 100_000, False),  # off
        (LIVE, 2048, 30_000, True),  # a live session's long new tail: its state is carried over
        (LIVE, 2048, 2047, False),
        (RESTORED, 2048, 4096, True),
        (LIVE, 0, 0, True),  # always
        (LIVE, None, 30_000, False),
        (Placement("e1", 0, Serve.COLD, prefix_from="s0"), 2048, 100_000, False),  # a prefix there
        (Placement("e1", 0, Serve.COLD, prefix_from="s0"), 0, 10, True),
        (Placement("e1", 0, Serve.COLD, handed_off=True), 0, 10, False),  # once
    ],
)
def test_which_turns_are_split(
    placement: Placement, threshold: int | None, tokens: int | None, split: bool
) -> None:
    assert split_for(placement, threshold, tokens) is split


@pytest.mark.parametrize(
    ("threshold", "added", "prefill_here", "whole"),
    [
        (2048, 2047, True, True),  # what it adds stays below: it may go early
        (2048, 2048, True, False),  # it may reach the threshold: the split decides after the read
        (2048, None, True, False),  # what it adds is unknown
        (0, 0, True, False),  # always split
        (None, 100_000, True, True),  # never split
        (0, 100_000, False, True),  # no prefill engine on its node
    ],
)
def test_a_warm_turn_goes_early_only_when_it_is_certainly_not_split(
    threshold: int | None, added: int | None, prefill_here: bool, whole: bool
) -> None:
    assert stays_whole(threshold, added, prefill_here) is whole


def test_the_uncached_tail_is_what_the_slot_would_evaluate() -> None:
    assert uncached_tail(COLD, 5000, 4000) == 5000  # a cold slot: the whole prompt
    assert uncached_tail(LIVE, 34_000, 4000) == 30_000  # its session's state there already
    assert uncached_tail(RESTORED, 3000, 4000) == 0  # (a prompt that leaves it early: rolled back)
    assert uncached_tail(LIVE, None, 4000) is None
    assert carries(LIVE) and carries(RESTORED) and not carries(COLD)
    assert not carries(Placement("e1", 0, Serve.COLD, prefix_from="s0"))
    # A fork's slot holds its parent's state, labelled with the parent: carried as that.
    assert carried_from(RESTORED, "parent") == "parent" and carried_from(RESTORED, None) == ""
    assert carried_from(COLD, "parent") == ""


def test_a_prefill_engine_of_the_same_node_first_else_of_another_in_turn() -> None:
    engines = [EngineRef(f"n{n}-e{i}", f"n{n}", "", "m", 2, role="prefill") for n in (1, 2) for i in (0, 1)]
    picked = [prefill_engine(engines, "n2", k) for k in range(3)]
    assert [e.engine for e in picked if e is not None] == ["n2-e0", "n2-e1", "n2-e0"]
    # None on the decode engine's node: the state goes node to node, from any node's in turn.
    away = [prefill_engine(engines, "n3", k) for k in range(5)]
    assert [e.engine for e in away if e is not None] == ["n1-e0", "n1-e1", "n2-e0", "n2-e1", "n1-e0"]
    assert prefill_engine([], "n1") is None


def test_the_tenants_threshold_over_the_gateways() -> None:
    settings = TurnSettings(lock_ttl_s=1, spill_wait_s=1, handoff_threshold=2048)
    assert threshold_for(Tenant("a"), settings) == 2048
    assert threshold_for(Tenant("a", handoff_threshold=0), settings) == 0
    assert threshold_for(Tenant("a", handoff_threshold=-1), settings) is None  # "off"
    off = TurnSettings(lock_ttl_s=1, spill_wait_s=1, handoff_threshold=None)
    assert threshold_for(Tenant("a"), off) is None
    assert parse_threshold("off") is None and parse_threshold("512") == 512
    tenants = parse_tenants(
        {
            "tenants": {
                "a": {"keys": ["k1"], "handoff_threshold": "off"},
                "b": {"keys": ["k2"], "handoff_threshold": 64},
            }
        }
    )
    assert tenants.by_name["a"].handoff_threshold == -1 and tenants.by_name["b"].handoff_threshold == 64
    with pytest.raises(TenantConfigError, match="handoff_threshold"):
        parse_tenants({"tenants": {"a": {"keys": ["k1"], "handoff_threshold": "never"}}})


def test_how_a_failed_handoff_counts() -> None:
    assert (
        failure(ApiError("refused", status=400, extra={"kind": "model_mismatch"})) is HandoffOutcome.REFUSED
    )
    assert failure(Unavailable("no free prefill slot", retry_after=1)) is HandoffOutcome.UNAVAILABLE
    assert failure(ApiError("down", status=502)) is HandoffOutcome.FAILED
    assert failure(RuntimeError("a bug")) is HandoffOutcome.FAILED


def test_the_request_is_checked_where_it_arrives() -> None:
    from engine_pool.errors import BadRequest
    from engine_pool.http.body import Body

    ok = HandoffRequest("t", "s", "n1-e0", {"messages": []})
    assert HandoffRequest.from_json(ok.to_json()) == ok
    assert "mode" not in ok.to_json() and "carry" not in ok.to_json()  # sparse: defaults left out
    carried = HandoffRequest("t", "s", "n1-e0", {"messages": []}, timeout_s=30, carry=True)
    assert HandoffRequest.from_json(carried.to_json()) == carried
    bad_ones = ({**ok.to_json(), "mode": "tokens"}, {**ok.to_json(), "body": []}, {"tenant": "t"})
    for bad in (*bad_ones, {**ok.to_json(), "timeout_s": 0}, {**ok.to_json(), "carry": "yes"}):
        with pytest.raises(BadRequest):
            HandoffRequest.from_body(Body(bad))


def test_only_nodes_that_cannot_meet_go_through_the_store() -> None:
    from engine_pool.errors import PeerUnreachable

    peer = HandoffRequest("t", "s", "n1-e0", {"messages": []}, prefill_node="http://n1:8070")
    unreachable = ApiError("no route", status=502, code="peer_unreachable")  # (as a NodeError reads)
    assert through_store(unreachable, peer)
    assert through_store(PeerUnreachable("no route"), peer)
    assert not through_store(ApiError("broke off", status=502), peer)  # reached: it failed there
    assert not through_store(unreachable, HandoffRequest("t", "s", "n1-e0", {"messages": []}))  # one node
    carried = HandoffRequest("t", "s", "n1-e0", {"messages": []}, carry=True, prefill_node="http://n1:8070")
    assert not through_store(unreachable, carried)  # a carried state never goes that way

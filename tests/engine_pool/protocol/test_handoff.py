"""The handoff's wire types (engine_pool.protocol.handoff): what each end writes the other reads; a
node-to-node request names its peer by an http(s) URL and nothing else."""

from __future__ import annotations

import pytest

from engine_pool.errors import BadRequest
from engine_pool.http.body import Body
from engine_pool.protocol.handoff import (
    HandoffRequest,
    HandoffResult,
    Prefilled,
    handoff_key,
    prefill_path,
    stored_at,
)

BODY = {"messages": [{"role": "user", "content": "Hi"}]}


def test_a_request_leaves_out_its_defaults_and_reads_back() -> None:
    plain = HandoffRequest("t", "s", "n1-e0", BODY)
    assert plain.to_json() == {"tenant": "t", "session": "s", "prefill_engine": "n1-e0", "body": BODY}
    peer = HandoffRequest("t", "s", "n1-e0", BODY, carry=True, prefill_node="http://10.0.0.5:8070", model="m")
    assert HandoffRequest.from_body(Body(peer.to_json())) == peer
    assert HandoffRequest.from_body(Body({**plain.to_json(), "prefill_node": ""})) == plain
    assert prefill_path("n1-e0") == "/v1/engines/n1-e0/prefill"


@pytest.mark.parametrize(
    "url",
    [
        "http://node-1.slotkeeper-node.ns.svc:8070",
        "https://10.0.0.5:8070/",
        "http://[fd00::5]:8070",
    ],
)
def test_a_peer_is_a_node_agents_url(url: str) -> None:
    req = HandoffRequest.from_body(
        Body({"tenant": "t", "session": "s", "prefill_engine": "e", "body": BODY, "prefill_node": url})
    )
    assert req.prefill_node == url


@pytest.mark.parametrize(
    "url",
    [
        "file:///etc/passwd",
        "gopher://x",
        "http://user:pw@host",
        "http://",
        "http://a b",
        "http://a?x=1",
        5,
        "x" * 3000,
    ],
)
def test_anything_else_is_refused_naming_the_field(url: object) -> None:
    with pytest.raises(BadRequest) as err:
        HandoffRequest.from_body(
            Body({"tenant": "t", "session": "s", "prefill_engine": "e", "body": BODY, "prefill_node": url})
        )
    assert err.value.param == "prefill_node"


def test_the_results_read_back() -> None:
    done = Prefilled(1, 900, 12345, 3, prefill_ms=10.5, export_ms=2.0, carried_bytes=7, carry_ms=1.0)
    assert Prefilled.from_json(done.to_json()) == done
    result = HandoffResult(
        "n1-e0", 1, 900, 900, 12345, 3, "logits", 10.5, 2.0, 3.0, 20.0, prefill_node="http://n1:8070"
    )
    assert HandoffResult.from_json(result.to_json()) == result


def test_a_store_key_is_a_handoff_key_and_nothing_else() -> None:
    key = handoff_key("0123456789abcdef" * 2)
    assert key == ".handoffs/0123456789abcdef0123456789abcdef.slot"
    assert stored_at("pfx", key) == "pfx/" + key and stored_at("", key) == key
    base = {"tenant": "t", "session": "s", "prefill_engine": "e", "body": BODY}
    req = HandoffRequest.from_body(Body({**base, "to_store": key, "from_store": key}))
    assert req.to_store == req.from_store == key
    for bad in ("../acme/s1/00000000000000000001.slot", ".handoffs/x.slot", "acme/.handoffs/" + key, 7):
        for field in ("to_store", "from_store"):
            with pytest.raises(BadRequest) as err:
                HandoffRequest.from_body(Body({**base, field: bad}))
            assert err.value.param == field

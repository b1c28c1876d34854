"""The node API's models: what each end writes is what the other reads, and the agent's parse
refuses a malformed request with a 400 naming the field (the agent itself: tests/engine_pool/pool)."""

from __future__ import annotations

from typing import Any

import pytest

from engine_pool.errors import BadRequest
from engine_pool.http.body import Body
from engine_pool.protocol.node import (
    MAX_FILL_TOKENS,
    EngineList,
    FillRequest,
    FillResult,
    ForgetResult,
    NodeEngine,
    SpillRequest,
    SpillResult,
    session_path,
    slot_path,
)


def test_requests_leave_out_their_defaults_and_read_back() -> None:
    plain = SpillRequest("t", "s", 3)
    assert plain.to_json() == {"tenant": "t", "session": "s", "generation": 3}
    full = SpillRequest("t", "s", 3, route="ab" * 8, share=False)
    assert full.to_json() == {**plain.to_json(), "route": "ab" * 8, "share": False}
    assert SpillRequest.from_body(Body(full.to_json())) == full
    fill = FillRequest("t", "s", 2, tokens=[1, 2, 3], prefix=True)
    assert FillRequest.from_body(Body(fill.to_json())) == fill
    assert FillRequest("t", "s", 2, tokens=[]).to_json() == {"tenant": "t", "session": "s", "generation": 2}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"session": "s", "generation": 1}, "tenant"),
        ({"tenant": "t", "session": "s"}, "generation"),
        ({"tenant": "t", "session": "s", "generation": 0}, "generation"),
        ({"tenant": 5, "session": "s", "generation": 1}, "tenant"),
        ({"tenant": "t", "session": "s", "generation": 1, "tokens": [1, -1]}, "tokens"),
        ({"tenant": "t", "session": "s", "generation": 1, "tokens": [0] * (MAX_FILL_TOKENS + 1)}, "tokens"),
        ({"tenant": "t", "session": "s", "generation": 1, "prefix": "yes"}, "prefix"),
    ],
)
def test_a_malformed_fill_names_its_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as err:
        FillRequest.from_body(Body(body))
    assert err.value.param == param


def test_results_round_trip() -> None:
    spill = SpillResult("t", "s", 1, "k", 100, 10, uploaded=True, ms=1.5, written=90)
    assert SpillResult.from_json(spill.to_json()) == spill
    older = {k: v for k, v in spill.to_json().items() if k != "written"}  # an agent that sent no `written`
    assert SpillResult.from_json(older).written == 0
    fill = FillResult(10, 100, "cut", 2.0)
    assert FillResult.from_json(fill.to_json()) == fill
    forget = ForgetResult("t", "s", 2)
    assert ForgetResult.from_json(forget.to_json()) == forget
    engines = EngineList("n1", (NodeEngine("n1-e0", "m", None, "starting", 2, 0, None),))
    assert EngineList.from_json(engines.to_json()) == engines


def test_paths_fill_the_routes_templates() -> None:
    assert slot_path("n1-e0", 3, "fill") == "/v1/engines/n1-e0/slots/3/fill"
    assert session_path("t", "s") == "/v1/sessions/t/s"

"""The suite's fuzz of one endpoint (tests/engine_pool/server/test_fuzz.py, formats/test_upstream.py,
tests/gateway/test_fuzz.py): generated bodies, each answered by a 2xx or a 4xx in the API's error
shape, never a 5xx (gateway.bench.harness.fuzz_verdict judges each answer)."""

from __future__ import annotations

import httpx
from hypothesis import given

from gateway.bench.harness.fuzz_bodies import Case, cases
from gateway.bench.harness.fuzz_specs import Endpoint
from gateway.bench.harness.fuzz_verdict import FUZZ, send, verdict


def assert_no_body_gets_a_5xx(client: httpx.Client, endpoint: Endpoint, model: str | None) -> None:
    """Sends `endpoint` the fuzz's bodies for `model`; the first answer that breaks the rule fails,
    with the case and its body in the message."""

    @FUZZ
    @given(case=cases(endpoint, model))
    def check(case: Case) -> None:
        problem = verdict(endpoint, send(client, endpoint, case))
        assert not problem, f"{case.describe()}: {problem}\nrequest body: {case.body[:3000]!r}"

    check()

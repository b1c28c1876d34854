"""storage.blobs.retry: backoff policy and the retry loop."""

from __future__ import annotations

import random

import pytest
from structlog.testing import capture_logs

from storage.blobs.retry import RetryPolicy, retrying
from storage.errors import StoreUnavailable


def test_policy_delays() -> None:
    policy = RetryPolicy(attempts=6, base_s=0.1, max_s=1.0, jitter=0.0)
    assert [policy.delay(i) for i in range(5)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0])
    assert policy.total_delay_s() == pytest.approx(2.5)
    jittered = RetryPolicy(base_s=1.0, max_s=1.0, jitter=0.5)
    assert all(0.5 <= jittered.delay(0, random.Random(i)) <= 1.0 for i in range(20))
    assert RetryPolicy().delay(10_000) == pytest.approx(RetryPolicy().max_s, rel=0.31)
    for bad in ({"attempts": 0}, {"base_s": -1}, {"jitter": 2}):
        with pytest.raises(ValueError):
            RetryPolicy(**bad)  # type: ignore[arg-type]


async def test_retries_transient_then_succeeds() -> None:
    calls = []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("boom")
        return "ok"

    with capture_logs() as logs:
        got = await retrying(
            "op", flaky, RetryPolicy(base_s=0.001), lambda e: isinstance(e, ConnectionError), key="k"
        )
    assert got == "ok" and len(calls) == 3
    assert [(e["event"], e["attempt"], e["key"]) for e in logs] == [
        ("storage.retry", 1, "k"),
        ("storage.retry", 2, "k"),
    ]


async def test_permanent_errors_are_not_retried_and_exhaustion_is_unavailable() -> None:
    calls = []

    async def broken() -> None:
        calls.append(1)
        raise ValueError("bad request")

    with pytest.raises(ValueError):
        await retrying("op", broken, RetryPolicy(base_s=0.001), lambda e: isinstance(e, ConnectionError))
    assert len(calls) == 1

    async def down() -> None:
        raise ConnectionRefusedError("down")

    with pytest.raises(StoreUnavailable) as info:
        await retrying(
            "op", down, RetryPolicy(attempts=2, base_s=0.001), lambda e: isinstance(e, ConnectionError)
        )
    assert isinstance(info.value.__cause__, ConnectionRefusedError) and info.value.status == 503

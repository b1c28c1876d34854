"""gateway.turn.opening's pure decisions: an opening read's refusal as the tenant's error, and a new
session refused by the tenant's quotas."""

from __future__ import annotations

from engine_pool.errors import QuotaExceeded, RateLimited
from gateway.tenants import Quotas, Tenant
from gateway.turn.opening import new_session_refusal, refusal
from storage.index.turnops import TurnStart


def test_a_refused_opening_read_is_the_tenants_429() -> None:
    tenant = Tenant("t", quotas=Quotas(requests_per_minute=10))
    assert refusal(tenant, TurnStart(), 4, now=0.0) is None
    rate = refusal(tenant, TurnStart(refused="rate"), 4, now=125.0)
    assert isinstance(rate, QuotaExceeded) and "10 requests per minute" in rate.message
    assert rate.retry_after == 55.0  # until its window turns
    inflight = refusal(tenant, TurnStart(refused="inflight"), 4, now=0.0)
    assert isinstance(inflight, RateLimited) and "4 requests running" in inflight.message


def test_a_new_session_is_refused_at_the_tenants_session_or_stored_bytes_quota() -> None:
    free = Tenant("t")
    assert new_session_refusal(free, TurnStart(sessions=10**6, stored_bytes=10**12)) is None
    capped = Tenant("t", quotas=Quotas(sessions=2, stored_bytes=100))
    assert new_session_refusal(capped, TurnStart(sessions=1, stored_bytes=99)) is None
    assert "limit of 2 sessions" in str(new_session_refusal(capped, TurnStart(sessions=2)))
    assert "100 bytes" in str(new_session_refusal(capped, TurnStart(stored_bytes=100)))

"""Retries with capped exponential backoff and jitter for transient failures.

The policy decides; :func:`retrying` carries it out and logs one ``storage.retry`` event per
retry. Only errors the classifier calls transient are retried; anything else propagates at once.
When attempts run out the last error is wrapped in :class:`StoreUnavailable`, so callers see one
error type for "the store is down" whichever client library failed.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import structlog

from storage.errors import StoreUnavailable

T = TypeVar("T")
log = structlog.get_logger("slotkeeper.storage")


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` tries in all; retry n waits ``min(max_s, base_s·2^n)`` minus up to ``jitter``."""

    attempts: int = 6
    base_s: float = 0.2
    max_s: float = 5.0
    jitter: float = 0.3

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.base_s < 0 or self.max_s < 0 or not 0 <= self.jitter <= 1:
            raise ValueError(f"invalid retry policy {self}")

    def delay(self, retry: int, rng: random.Random | None = None) -> float:
        base = min(self.max_s, self.base_s * (2 ** min(retry, 32)))
        return base * (1 - self.jitter * (rng or random).random())

    def total_delay_s(self) -> float:
        """The longest outage the policy rides out (jitter ignored)."""
        return sum(min(self.max_s, self.base_s * 2 ** min(i, 32)) for i in range(self.attempts - 1))


async def retrying(
    what: str,
    call: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    transient: Callable[[BaseException], bool],
    **log_context: object,
) -> T:
    """Await ``call()`` until it succeeds, a non-transient error occurs, or attempts run out."""
    for attempt in range(policy.attempts):
        try:
            return await call()
        except Exception as exc:
            if not transient(exc):
                raise
            if attempt + 1 >= policy.attempts:
                log.warning(
                    "storage.retry_exhausted",
                    op=what,
                    attempts=policy.attempts,
                    error=repr(exc),
                    **log_context,
                )
                raise StoreUnavailable(f"{what} failed after {policy.attempts} attempts: {exc}") from exc
            delay = policy.delay(attempt)
            log.info(
                "storage.retry",
                op=what,
                attempt=attempt + 1,
                delay_s=round(delay, 3),
                error=repr(exc),
                **log_context,
            )
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")

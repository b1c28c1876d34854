"""Prompt progress (llama-server's `return_progress`): the core's progress events as llama-server
reports them.

The core sends a progress event when a request's prompt starts (what was reused) and after every
prompt chunk it evaluates. llama-server reports the same moments, with one difference in counting:
it always evaluates a prompt's last token again, even for a prompt its cache holds whole, so its
`cache` never reaches `total` and a stream always shows at least two reports, the last with
`processed == total`. Our core serves an identical prompt from the stored logits of its last
position without evaluating anything; `reports` counts that last token as processed rather than
cached, so the reports read as llama-server's (its suite checks exactly this), while the `timings`
beside them keep what the core did (`cache_n` = every token).
"""

from __future__ import annotations

from dataclasses import dataclass

import native

from ..protocol.engine_answers import PromptProgress, Timings


@dataclass(frozen=True)
class Progress:
    """One `prompt_progress` report, with the `timings` so far (sent with `timings_per_token`)."""

    total: int
    cache: int
    processed: int
    time_ms: int
    timings: Timings

    def to_json(self) -> PromptProgress:
        return {
            "total": self.total,
            "cache": self.cache,
            "processed": self.processed,
            "time_ms": self.time_ms,
        }


def reports(total: int, cache_n: int, prompt_n: int, elapsed_ms: float, timings: Timings) -> list[Progress]:
    """The reports for one core progress event of a prompt of `total` tokens, `cache_n` reused and
    `prompt_n` evaluated so far. Pure.

    The start of a prompt the cache holds whole (`cache_n == total`) is two reports: the cache
    short of the last token, then that token processed (module doc)."""
    time_ms = int(elapsed_ms)
    if total > 0 and cache_n >= total:
        cache = total - 1
        return [
            Progress(total, cache, cache, time_ms, timings),
            Progress(total, cache, total, time_ms, timings),
        ]
    return [Progress(total, cache_n, cache_n + prompt_n, time_ms, timings)]


def from_event(ev: native.Event, timings: Timings) -> list[Progress]:
    """`reports` for a core progress event (`timings`: its timings, rendered)."""
    t = ev.timings
    return reports(ev.prompt_total, t.cache_n, t.prompt_n, ev.elapsed_ms, timings)

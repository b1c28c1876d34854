"""One generation on one slot: lease, run on the core, decode, stop strings, timings.

`generate` is the only code that submits generation requests to the core. It takes a slot lease
from the scheduler, streams the core's events, turns token pieces into text deltas (incremental
UTF-8, stop strings held back and matched), cancels the core request when a stop string matched
(and still waits for the core's final event, which carries the timings), and gives the lease back
once the core is done with the slot. Leaving the iteration early — a client that went away — cancels
the core request the same way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import structlog
from starlette.requests import Request

import native

from ..errors import ClientGone, ContextSizeExceeded, ServerError, Unavailable
from .runtime import Runtime
from .sampling import Sampling, to_native
from .text_stream import TextStream

log = structlog.get_logger("engine.generation")


@dataclass(frozen=True)
class Delta:
    """New text (possibly empty while a stop string may be forming) and the tokens that made it."""

    text: str
    tokens: list[int]


@dataclass
class Outcome:
    """How a generation ended."""

    text: str
    tokens: list[int]
    slot: int
    n_prompt: int
    stop_type: str  # eos | word | limit | none (llama-server's names)
    stopping_word: str
    timings: dict[str, Any]
    ttft_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def finish_reason(self) -> str:
        return "length" if self.stop_type == "limit" else "stop"

    @property
    def cache_n(self) -> int:
        return int(self.timings["cache_n"])

    @property
    def n_predicted(self) -> int:
        return int(self.timings["predicted_n"])


_STOP_TYPE = {"eos": "eos", "stop_token": "eos", "length": "limit", "context": "limit", "cancelled": "none"}


def timings_dict(t: native.Timings) -> dict[str, Any]:
    """llama-server's `timings` object, plus how the reused prefix was served."""

    def per(n: int, ms: float) -> tuple[float, float]:
        return (ms / n if n else 0.0, 1000.0 * n / ms if ms > 0 else 0.0)

    p_tok, p_sec = per(t.prompt_n, t.prompt_ms)
    g_tok, g_sec = per(t.predicted_n, t.predicted_ms)
    return {
        "cache_n": t.cache_n,
        "prompt_n": t.prompt_n,
        "prompt_ms": t.prompt_ms,
        "prompt_per_token_ms": p_tok,
        "prompt_per_second": p_sec,
        "predicted_n": t.predicted_n,
        "predicted_ms": t.predicted_ms,
        "predicted_per_token_ms": g_tok,
        "predicted_per_second": g_sec,
        "reuse": t.reuse,
        "restored": t.restored,
        "checkpoints_created": t.checkpoints_created,
    }


async def generate(
    rt: Runtime,
    prompt: list[int],
    sampling: Sampling,
    *,
    grammar: str = "",
    checkpoint_hints: list[int] | None = None,
    extra_bias: dict[int, float] | None = None,
    endpoint: str = "",
    preserved: frozenset[int] = frozenset(),
) -> AsyncGenerator[Delta | Outcome, None]:
    """Deltas as they come, then one Outcome. Iterate inside `aclosing` so that leaving early cancels.

    `preserved`: special tokens whose text belongs in the output (a chat format's tags, such as
    LFM2's `<|tool_call_start|>`, a CONTROL token llama.cpp otherwise renders as nothing), like
    llama-server's preserved tokens."""
    engine = rt.require()
    n_ctx = engine.n_ctx_slot
    if len(prompt) >= n_ctx:
        raise ContextSizeExceeded(len(prompt), n_ctx)
    params = to_native(
        sampling, prompt, grammar=grammar, checkpoint_hints=checkpoint_hints, extra_bias=extra_bias
    )
    t0 = time.monotonic()
    slot = await rt.scheduler.acquire(sampling.id_slot, prompt)
    held_tokens = rt.scheduler.n_tokens(slot)
    text = TextStream(sampling.stop)
    tokens: list[int] = []
    done: native.Event | None = None
    request_id: int | None = None
    ended = False  # the core sent this request's last event: the slot is idle there
    ttft = 0.0
    try:
        # The facade annotates stream() as an AsyncIterator; it is an async generator.
        async with aclosing(engine.stream(slot, params)) as events:  # type: ignore[type-var]
            async for ev in events:
                request_id = ev.request_id
                if ev.kind == "token":
                    if text.stopped_by is not None:
                        continue  # produced before our cancel reached the core
                    if not tokens:
                        ttft = time.monotonic() - t0
                    tokens.append(ev.token)
                    piece = engine.token_piece(ev.token, True) if ev.token in preserved else ev.piece
                    delta = text.feed(piece)
                    if text.stopped_by is not None:
                        await asyncio.to_thread(engine.cancel, ev.request_id)
                    yield Delta(delta, [ev.token])
                elif ev.kind == "done":
                    done, ended = ev, True
                else:
                    ended = True
                    raise ServerError(f"generation failed on slot {slot}: {ev.message}")
    finally:
        if ended:
            rt.scheduler.release(slot)
        else:
            rt.abort_on_slot(slot, request_id)
    if done is None:  # the stream ended without its final event: the engine closed under us
        raise ServerError("the engine stopped before the generation finished")
    if done.stop_reason == "cancelled" and text.stopped_by is None and rt.draining:
        raise Unavailable(
            "the engine is shutting down; the generation was aborted", retry_after=rt.settings.retry_after_s
        )
    rest = text.finish()
    if rest:
        yield Delta(rest, [])
    stop_type = "word" if text.stopped_by is not None else _STOP_TYPE.get(done.stop_reason, "none")
    outcome = Outcome(
        text=text.text,
        tokens=tokens,
        slot=slot,
        n_prompt=len(prompt),
        stop_type=stop_type,
        stopping_word=text.stopped_by or "",
        timings=timings_dict(done.timings),
        ttft_s=ttft,
    )
    _log_outcome(rt, outcome, held_tokens, endpoint)
    yield outcome


def _log_outcome(rt: Runtime, o: Outcome, held_tokens: int, endpoint: str) -> None:
    t = o.timings
    rt.metrics.generation_done(endpoint, o)
    log.info(
        "generation.done",
        endpoint=endpoint,
        slot=o.slot,
        n_prompt=o.n_prompt,
        prompt_n=t["prompt_n"],
        cache_n=t["cache_n"],
        reuse=t["reuse"],
        restored=t["restored"],
        predicted_n=t["predicted_n"],
        stop_type=o.stop_type,
        ttft_ms=round(o.ttft_s * 1000.0, 2),
    )
    if t["restored"] and held_tokens > 0 and t["cache_n"] == 0:
        # A restored session that still re-prefilled: exactly what this project exists to avoid.
        log.warning("restore.reprefilled", slot=o.slot, restored_tokens=held_tokens, n_prompt=o.n_prompt)


async def collect(gen: AsyncGenerator[Delta | Outcome, None], request: Request | None = None) -> Outcome:
    """Run a generation to its Outcome; a client that disconnects first cancels it."""

    async def run() -> Outcome:
        async with aclosing(gen) as items:
            async for item in items:
                if isinstance(item, Outcome):
                    return item
        raise ServerError("the generation ended without an outcome")

    if request is None:
        return await run()
    task = asyncio.ensure_future(run())
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if not task.done() or task.cancelled():
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone("the client disconnected; the generation was cancelled")
    return task.result()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return

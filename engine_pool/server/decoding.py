"""One decode run on one slot: lease, run on the core, decode, stop strings, timings.

`decode_on_slot` is the only code that submits decode requests to the core. It takes a slot lease
from `SlotLeases`, streams the core's events, turns token pieces into text deltas (incremental
UTF-8, stop strings held back and matched), cancels the core request when a stop string matched
(and still waits for the core's final event, which carries the timings), and gives the lease back
once the core is done with the slot. Leaving the iteration early — a client that went away — cancels
the core request the same way.

What a decode run reports: llama-server's `timings` (numbers only, as its clients parse them) and,
beside them, how the prompt's prefix was served (`reuse`: live, checkpoint, logits or none; whether
the slot was restored from a file; checkpoints captured) — sent as the `slotkeeper` field of every
response that carries `timings`. With `n_probs`, each token's log-probability and its step's most
likely tokens (from the raw logits), rendered in llama-server's and OpenAI's shapes below.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

import structlog
from starlette.requests import Request

import native
from engine_pool.errors import ClientGone, ContextSizeExceeded, ServerError, SlotChanged, Unavailable

from ..protocol.engine_answers import CompletionLogprobs, Timings, TokenLogprob, TokenPiece
from ..protocol.report import ReuseReport
from .grammar import GrammarTriggers
from .progress import Progress, from_event
from .runtime import Runtime
from .sampling import Sampling, ban_end_of_generation, resolve_text_bias, to_native
from .text_stream import TextStream

log = structlog.get_logger("engine.decoding")


@dataclass(frozen=True)
class TokenProb:
    """A generated token's log-probability and the most likely tokens of its step (id, logprob),
    from the raw logits (llama-server's `n_probs` without `post_sampling_probs`)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Delta:
    """New text (possibly empty while a stop string may be forming) and the tokens that made it
    (with their probabilities when the request asked for `n_probs`)."""

    text: str
    tokens: list[int]
    probs: tuple[TokenProb, ...] = ()
    timings: Timings | None = None  # the timings so far, with `timings_per_token`


@dataclass
class Outcome:
    """How a decode run ended."""

    text: str
    tokens: list[int]
    slot: int
    n_prompt: int
    stop_type: str  # eos | word | limit | none (llama-server's names)
    stopping_word: str
    timings: Timings
    reuse: ReuseReport = field(default_factory=lambda: ReuseReport())  # the response's `slotkeeper` field
    probs: list[TokenProb] = field(default_factory=list)
    ttft_s: float = 0.0

    @property
    def finish_reason(self) -> str:
        return "length" if self.stop_type == "limit" else "stop"

    @property
    def cache_n(self) -> int:
        return int(self.timings["cache_n"])

    @property
    def n_predicted(self) -> int:
        return int(self.timings["predicted_n"])


# What a decode run yields: progress reports (when asked for), text deltas, then one Outcome.
Decoded = Progress | Delta | Outcome


_STOP_TYPE = {
    "eos": "eos",
    "stop_token": "eos",
    "stop_word": "word",
    "length": "limit",
    "context": "limit",
    "cancelled": "none",
}


# llama-server's floor for the generation time: its clock starts at the first token, so one token
# takes max(1 µs, 0) and reports 1e6 tokens/s.
_MIN_MS = 0.001


def _rates(n: int, ms: float, steps: int | None = None) -> tuple[float, float, float]:
    """(ms, ms per step, steps per second) as llama-server computes them (`1e3 / ms * steps`; the
    steps are the `n` tokens unless said), with its 1 µs floor once a token exists; 0 where it would
    divide by zero."""
    if n <= 0:
        return ms, 0.0, 0.0
    ms = max(ms, _MIN_MS)
    steps = n if steps is None else steps
    if steps <= 0:
        return ms, 0.0, 0.0
    return ms, ms / steps, 1e3 / ms * steps


def timings_dict(t: native.Timings) -> Timings:
    """llama-server's `timings` object: numbers only.

    llama-server counts the time to the first token as prompt time and generation from the first
    token on; our core's decode clock starts when the prompt is done. With one token that whole
    time is llama-server's prompt time; with more, the first token's sampling stays in
    `predicted_ms` here (microseconds). Generation rates are over decode steps, one fewer than the
    tokens: the first token comes from the last prompt batch's logits (llama-server b11434's
    `n_gen_steps`), so one token reports 0 per second and per token."""
    prompt_ms, predicted_ms = t.prompt_ms, t.predicted_ms
    if t.predicted_n == 1:
        prompt_ms, predicted_ms = prompt_ms + predicted_ms, 0.0
    prompt_ms, prompt_tok, prompt_sec = _rates(t.prompt_n, prompt_ms)
    pred_ms, pred_tok, pred_sec = _rates(t.predicted_n, predicted_ms, max(t.predicted_n - 1, 0))
    return {
        "cache_n": t.cache_n,
        "prompt_n": t.prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_tok,
        "prompt_per_second": prompt_sec,
        "predicted_n": t.predicted_n,
        "predicted_ms": pred_ms,
        "predicted_per_token_ms": pred_tok,
        "predicted_per_second": pred_sec,
    }


def reuse_dict(t: native.Timings) -> ReuseReport:
    """How the prompt's prefix was served (the `slotkeeper` field next to `timings`): `reuse` is
    live | checkpoint | logits | none, `restored` says the slot's state came from a slot file."""
    out: ReuseReport = {
        "reuse": t.reuse,
        "restored": t.restored,
        "checkpoints_created": t.checkpoints_created,
    }
    if t.source_slot >= 0:
        out["source_slot"] = t.source_slot
    if t.candidate_n > 0:  # what the prompt was compared with (engine_pool.server.divergence)
        out["prefix"] = {
            "slot": t.candidate_slot,
            "tokens": t.candidate_n,
            "prompt_tokens": t.candidate_prompt_n,
            "common": t.common_n,
        }
    return out


async def with_biases(rt: Runtime, sampling: Sampling) -> Sampling:
    """`sampling` with its text-keyed `logit_bias` tokenized (in a worker thread) and, with
    `ignore_eos`, the end-of-generation tokens banned."""
    model = rt.require().model
    sampling = ban_end_of_generation(sampling, (model.eos, model.eot))
    if not sampling.logit_bias_text:
        return sampling
    return await asyncio.to_thread(
        resolve_text_bias,
        sampling,
        lambda text: rt.tokenize(text, False, False),
        rt.settings.max_logit_bias,
    )


async def decode_on_slot(
    rt: Runtime,
    prompt: list[int],
    sampling: Sampling,
    *,
    grammar: str = "",
    triggers: GrammarTriggers | None = None,
    checkpoint_hints: list[int] | None = None,
    extra_bias: dict[int, float] | None = None,
    endpoint: str = "",
    preserved: frozenset[int] = frozenset(),
) -> AsyncGenerator[Decoded, None]:
    """Deltas as they come, then one Outcome. Iterate inside `aclosing` so that leaving early cancels.
    With `sampling.return_progress`, Progress reports come first, while the prompt is evaluated.

    `preserved`: special tokens whose text belongs in the output (a chat format's tags, such as
    LFM2's `<|tool_call_start|>`, a CONTROL token llama.cpp otherwise renders as nothing), like
    llama-server's preserved tokens."""
    engine = rt.require()
    n_ctx = engine.n_ctx_slot
    if len(prompt) >= n_ctx:
        raise ContextSizeExceeded(len(prompt), n_ctx)
    sampling = await with_biases(rt, sampling)
    params = to_native(
        sampling,
        prompt,
        grammar=grammar,
        triggers=triggers,
        checkpoint_hints=checkpoint_hints,
        extra_bias=extra_bias,
        n_slots=rt.settings.n_slots,
        preserved=preserved,
    )
    t0 = time.monotonic()
    slot = await rt.leases.acquire(sampling.id_slot, prompt)
    expected = (sampling.slot_owner, sampling.slot_expect)
    if sampling.slot_expect and rt.leases.label_of(slot) != expected:
        rt.leases.release(slot)  # the gateway places the session again (from its stored state)
        raise SlotChanged(f"slot {slot} does not hold the session {sampling.slot_expect!r}")
    rt.leases.label(slot, sampling.slot_owner, sampling.slot_session)
    held_tokens = rt.leases.n_tokens(slot)
    text = TextStream(sampling.stop)
    tokens: list[int] = []
    probs: list[TokenProb] = []
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
                    timings = timings_dict(ev.timings) if sampling.timings_per_token else None
                    if sampling.n_probs:
                        probs.append(TokenProb(ev.token, ev.logprob, tuple(ev.top_logprobs)))
                        yield Delta(delta, [ev.token], (probs[-1],), timings)
                    else:
                        yield Delta(delta, [ev.token], timings=timings)
                elif ev.kind == "progress":
                    for report in from_event(ev, timings_dict(ev.timings)):
                        yield report
                elif ev.kind == "done":
                    done, ended = ev, True
                else:
                    ended = True
                    raise ServerError(f"generation failed on slot {slot}: {ev.message}")
    finally:
        if ended:
            rt.leases.release(slot)
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
        reuse=reuse_dict(done.timings),
        probs=probs,
        ttft_s=ttft,
    )
    _log_outcome(rt, outcome, held_tokens, endpoint)
    yield outcome


def _log_outcome(rt: Runtime, o: Outcome, held_tokens: int, endpoint: str) -> None:
    t, r = o.timings, o.reuse
    rt.metrics.decode_done(endpoint, o)
    log.info(
        "generation.done",
        endpoint=endpoint,
        slot=o.slot,
        n_prompt=o.n_prompt,
        prompt_n=t["prompt_n"],
        cache_n=t["cache_n"],
        reuse=r["reuse"],
        restored=r["restored"],
        predicted_n=t["predicted_n"],
        stop_type=o.stop_type,
        ttft_ms=round(o.ttft_s * 1000.0, 2),
    )
    if r["restored"] and held_tokens > 0 and t["cache_n"] == 0:
        # A restored session that still re-prefilled: exactly what this project exists to avoid.
        log.warning("restore.reprefilled", slot=o.slot, restored_tokens=held_tokens, n_prompt=o.n_prompt)


async def collect(gen: AsyncGenerator[Decoded, None], request: Request | None = None) -> Outcome:
    """Drive a decode run to its Outcome; a client that disconnects first cancels it."""

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


async def collect_all(
    gens: Sequence[AsyncGenerator[Decoded, None]], request: Request | None = None
) -> list[Outcome]:
    """Drive several decode runs at once (each takes its own slot lease, queueing like any request)
    to their Outcomes, in order; the first failure cancels the others and is raised."""
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(collect(g, request)) for g in gens]
    except BaseExceptionGroup as group:
        raise group.exceptions[0] from None
    return [t.result() for t in tasks]


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# -- token probabilities, in llama-server's and OpenAI's shapes ----------------------------------------
TokenBytes = Callable[[int], bytes]  # a token's piece (`engine.token_piece(t, True)`)

# llama-server's stand-in for log(0), which JSON cannot carry (float32's lowest).
_LOG_ZERO = -3.4028234663852886e38


def token_pieces(engine: native.Engine) -> TokenBytes:
    """A token's piece (special tokens spelled out), remembered for one request's probabilities."""
    seen: dict[int, bytes] = {}

    def piece(token: int) -> bytes:
        if token not in seen:
            seen[token] = engine.token_piece(token, True)
        return seen[token]

    return piece


def _logprob(x: float) -> float:
    return x if math.isfinite(x) else _LOG_ZERO


def _token(token: int, piece: TokenBytes) -> TokenPiece:
    raw = piece(token)
    # A piece can end inside a character: its text keeps the complete ones, `bytes` has them all.
    return {"id": token, "token": raw.decode("utf-8", "ignore"), "bytes": list(raw)}


def probs_json(probs: Sequence[TokenProb], piece: TokenBytes, n_top: int | None = None) -> list[TokenLogprob]:
    """llama-server's `completion_probabilities` (and `logprobs.content` of chat, a superset of
    OpenAI's entries): per token `id`, `token`, `bytes`, `logprob`, `top_logprobs` (its first `n_top`)."""
    return [
        {
            **_token(p.token, piece),
            "logprob": _logprob(p.logprob),
            "top_logprobs": [{**_token(t, piece), "logprob": _logprob(lp)} for t, lp in p.top[:n_top]],
        }
        for p in probs
    ]


def completion_logprobs(
    probs: Sequence[TokenProb], piece: TokenBytes, n_top: int, offset: int = 0
) -> CompletionLogprobs:
    """OpenAI's legacy completions `logprobs` (tokens, token_logprobs, top_logprobs as {text:
    logprob}, text_offset from `offset` characters), plus llama-server's `content` entries."""
    content = probs_json(probs, piece, n_top)
    offsets = []
    for c in content:
        offsets.append(offset)
        offset += len(c["token"])
    return {
        "tokens": [c["token"] for c in content],
        "token_logprobs": [c["logprob"] for c in content],
        "top_logprobs": [{t["token"]: t["logprob"] for t in c["top_logprobs"]} for c in content],
        "text_offset": offsets,
        "content": content,
    }

"""The engine's answers in OpenAI's shapes: what every object and chunk repeats (`Meta`), `usage`,
llama-server's extras beside them, a chat choice, and the chunk streams of a chat and of a text
completion.

Beyond OpenAI's shape: `timings` (numbers only), `slotkeeper` (how the prefix was served) and
`id_slot` (`extras`) on answers and last chunks, `message.reasoning_content` /
`delta.reasoning_content` when the model reasoned, and a choice's `stopping_word` when a stop string
ended the generation. `n` choices are decode runs of their own; their prompt counts once in `usage`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass

import native

from ..protocol.engine_answers import (
    AssistantMessage,
    ChatChoice,
    ChatChunk,
    ChatLogprobs,
    ChunkChoice,
    ChunkDelta,
    Extras,
    Head,
    LlamaCompletion,
    TextChoice,
    TextCompletion,
    Timings,
    ToolCallDelta,
    Usage,
)
from .chat_request import ChatRequest
from .decoding import Decoded, Delta, Outcome, TokenBytes, TokenProb, completion_logprobs, probs_json
from .formats import ChatOutput, Piece, Reasoning, assemble
from .formats.upstream import UpstreamOutput
from .progress import Progress

Output = ChatOutput | UpstreamOutput  # a generation's text read as reasoning, content and calls


@dataclass(frozen=True)
class Meta:
    """What every response and chunk of one request repeats."""

    id: str
    object: str
    created: int
    model: str

    def head(self) -> Head:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": f"slotkeeper-{native.ENGINE_VERSION}",
        }


def usage(outcomes: list[Outcome], n: int = 1) -> Usage:
    """OpenAI's usage of a request's decode runs, `n` consecutive ones per prompt: a prompt counts
    once (as OpenAI bills `n` choices), with the tokens its first decode run reused."""
    firsts = outcomes[::n]
    prompt = sum(o.n_prompt for o in firsts)
    completion = sum(o.n_predicted for o in outcomes)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.cache_n for o in firsts)},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def extras(o: Outcome) -> Extras:
    """llama-server's fields beyond OpenAI's (and ours beside them) for one decode run."""
    return {"timings": o.timings, "slotkeeper": o.reuse, "id_slot": o.slot}


# -- chat ----------------------------------------------------------------------------------------
def chat_choice(
    index: int, o: Outcome, pieces: list[Piece], req: ChatRequest, token_bytes: TokenBytes, *, several: bool
) -> ChatChoice:
    msg = assemble(pieces)
    message: AssistantMessage = {"role": "assistant", "content": msg.content}
    if msg.reasoning:
        message["reasoning_content"] = msg.reasoning
    if msg.calls:
        message["tool_calls"] = [c.as_openai() for c in msg.calls]
    choice: ChatChoice = {
        "index": index,
        "message": message,
        "logprobs": _chat_logprobs(o.probs, req, token_bytes),
        "finish_reason": "tool_calls" if msg.calls else o.finish_reason,
    }
    if o.stop_type == "word":
        choice["stopping_word"] = o.stopping_word
    if several:  # each choice is a decode run of its own: its timings and slot go with it
        choice.update(extras(o))
    return choice


def _chat_logprobs(probs: list[TokenProb], req: ChatRequest, token_bytes: TokenBytes) -> ChatLogprobs | None:
    if req.top_logprobs is None:
        return None
    return {"content": probs_json(probs, token_bytes, req.top_logprobs), "refusal": None}


def _chat_usage(o: Outcome, out: Output) -> Usage:
    u = usage([o])
    u["completion_tokens_details"]["reasoning_tokens"] = out.reasoning_tokens
    return u


async def chat_chunks(
    gen: AsyncGenerator[Decoded, None],
    req: ChatRequest,
    out: Output,
    meta: Meta,
    token_bytes: TokenBytes,
    explain: Callable[[Outcome], Awaitable[None]],
    debug: Callable[[Outcome], Awaitable[LlamaCompletion]] | None,
    n_prompt: int,
) -> AsyncGenerator[ChatChunk, None]:
    """The chunks of one streamed chat. The first (the assistant's role) also carries
    `slotkeeper.prompt_tokens`, the prompt's size once its evaluation is done, which the Messages
    stream reports in its `message_start`; the finishing one `__verbose` when asked for."""
    w = _ChunkWriter(req, meta, token_bytes)
    started = False
    async with aclosing(gen) as items:
        async for item in items:
            if not started:
                started = True
                first = w.chunk({"role": "assistant", "content": None})  # as OpenAI and llama-server
                first["slotkeeper"] = {"prompt_tokens": n_prompt}
                if isinstance(item, Progress):
                    yield _with_progress(first, item, req.sampling.timings_per_token)
                    continue
                yield first
            if isinstance(item, Progress):
                # llama-server's progress chunk: the assistant's role again, with the report.
                yield _with_progress(
                    w.chunk({"role": "assistant", "content": None}), item, req.sampling.timings_per_token
                )
                continue
            if isinstance(item, Delta):
                w.pending.extend(item.probs)
                for c in w.with_timings(
                    w.with_probs(w.pieces(out.feed(item.text, len(item.tokens)))), item.timings
                ):
                    yield c
                continue
            for c in w.with_probs(w.pieces(out.finish())):
                yield c
            await explain(item)
            last = w.with_probs([w.chunk({}, "tool_calls" if w.n_calls else item.finish_reason)])[0]
            if item.stop_type == "word":
                last["choices"][0]["stopping_word"] = item.stopping_word
            last.update(extras(item))
            if debug is not None:
                last["__verbose"] = await debug(item)
            yield last
            if req.include_usage:
                yield {**w.head, "choices": [], "usage": _chat_usage(item, out), **extras(item)}


class _ChunkWriter:
    """The chunks of one streamed chat choice: each carries the request's head, its tool calls are
    numbered in order, and the probabilities of tokens whose text no chunk carried yet (`pending`)
    go on the next chunk that carries text."""

    def __init__(self, req: ChatRequest, meta: Meta, token_bytes: TokenBytes) -> None:
        self.req, self.token_bytes = req, token_bytes
        self.head: Head = {**meta.head(), "object": "chat.completion.chunk"}
        self.n_calls = 0
        self.pending: list[TokenProb] = []

    def chunk(self, delta: ChunkDelta, finish: str | None = None) -> ChatChunk:
        choice: ChunkChoice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        c: ChatChunk = {**self.head, "choices": [choice]}
        if self.req.include_usage:
            c["usage"] = None
        return c

    def pieces(self, parts: list[Piece]) -> list[ChatChunk]:
        chunks: list[ChatChunk] = []
        for p in parts:
            if isinstance(p, str):
                if p:
                    chunks.append(self.chunk({"content": p}))
                continue
            if isinstance(p, Reasoning):
                if p.text:
                    chunks.append(self.chunk({"reasoning_content": p.text}))
                continue
            fn_head: ToolCallDelta = {
                "index": self.n_calls,
                "id": p.id,
                "type": "function",
                "function": {"name": p.name, "arguments": ""},
            }
            chunks.append(self.chunk({"tool_calls": [fn_head]}))
            arguments: ToolCallDelta = {"index": self.n_calls, "function": {"arguments": p.arguments}}
            chunks.append(self.chunk({"tool_calls": [arguments]}))
            self.n_calls += 1
        return chunks

    def with_probs(self, chunks: list[ChatChunk]) -> list[ChatChunk]:
        """A chunk carries the probabilities of the tokens that made it (and of held-back ones before)."""
        if chunks and self.pending:
            chunks[-1]["choices"][0]["logprobs"] = _chat_logprobs(self.pending, self.req, self.token_bytes)
            self.pending.clear()
        return chunks

    @staticmethod
    def with_timings(chunks: list[ChatChunk], timings: Timings | None) -> list[ChatChunk]:
        if chunks and timings is not None:  # `timings_per_token`: on the token's last chunk
            chunks[-1]["timings"] = timings
        return chunks


# -- text completions ----------------------------------------------------------------------------
async def completion_chunks(
    gen: AsyncGenerator[Decoded, None],
    meta: Meta,
    include_usage: bool,
    top: int | None,
    token_bytes: TokenBytes,
    timings_per_token: bool = False,
) -> AsyncGenerator[TextCompletion, None]:
    head = meta.head()
    offset = 0  # characters of the completion so far: where the next chunk's tokens start

    def chunk(text: str, finish: str | None, probs: tuple[TokenProb, ...] = ()) -> TextCompletion:
        nonlocal offset
        logprobs = None
        if top is not None and probs:
            logprobs = completion_logprobs(probs, token_bytes, top, offset)
        offset += len(text)
        choice: TextChoice = {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}
        out: TextCompletion = {**head, "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out

    async with aclosing(gen) as items:
        async for item in items:
            if isinstance(item, Progress):
                report = chunk("", None)
                if timings_per_token:
                    report["timings"] = item.timings
                report["prompt_progress"] = item.to_json()
                yield report
                continue
            if isinstance(item, Delta):
                if item.text or item.probs:
                    c = chunk(item.text, None, item.probs)
                    if item.timings is not None:
                        c["timings"] = item.timings
                    yield c
                continue
            last = chunk("", item.finish_reason)
            last.update(extras(item))
            yield last
            if include_usage:
                yield {**head, "choices": [], "usage": usage([item]), **extras(item)}


def _with_progress(c: ChatChunk, p: Progress, timings_per_token: bool) -> ChatChunk:
    """A chat chunk carrying a prompt progress report (and the timings so far, when asked for)."""
    if timings_per_token:
        c["timings"] = p.timings
    c["prompt_progress"] = p.to_json()
    return c

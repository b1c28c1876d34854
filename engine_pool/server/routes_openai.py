"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models.

Responses follow the OpenAI API as the official SDK parses it, plus llama-server's extras: `timings`
on responses and on the last stream chunk, `id_slot` (which slot served the request), and
`usage.prompt_tokens_details.cached_tokens` = the prompt tokens actually reused (timings.cache_n,
restored ones included).
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import native

from ..body import Body, json_type, read_json
from ..errors import BadRequest
from .chat_request import ChatRequest, build_constraint, parse_chat
from .formats import (
    ChatFormat,
    ChatOutput,
    Piece,
    Reasoning,
    assemble,
    opened_by,
    prepare_history,
    select_format,
)
from .formats.reasoning import THINK_CLOSE, THINK_OPEN
from .generation import Delta, Outcome, collect, generate
from .limits import RequestLimits, check_count, check_text
from .routes_llama import check_prompt, completion_prompt, limits, runtime
from .runtime import Runtime
from .sampling import read_sampling
from .sse import start_stream


@dataclass(frozen=True)
class Meta:
    """What every response and chunk of one request repeats."""

    id: str
    object: str
    created: int
    model: str

    def head(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": f"slotkeeper-{native.ENGINE_VERSION}",
        }


def usage(outcomes: list[Outcome]) -> dict[str, Any]:
    prompt = sum(o.n_prompt for o in outcomes)
    completion = sum(o.n_predicted for o in outcomes)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.cache_n for o in outcomes)},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


# -- chat ---------------------------------------------------------------------------------------
async def chat_completions(request: Request) -> Response:
    lim = limits(request)
    body = await read_json(request, lim.body)
    result = await run_chat(request, body)
    if isinstance(result, dict):
        return JSONResponse(result)
    return await start_stream(result, done_marker=True)


async def run_chat(request: Request, body: Body) -> dict[str, Any] | AsyncGenerator[dict[str, Any], None]:
    """One chat completion from a parsed body: the response object, or (`stream`) its chunks.

    The Responses and Messages routes call this with a body translated from their own shapes and
    translate what comes back, so every API shares one chat path (templates, formats, grammars).
    Beyond OpenAI's shape: `message.reasoning_content` / `delta.reasoning_content` (when the model
    reasoned), and the final choice's `stopping_word` when a stop string ended the generation.
    """
    rt = runtime(request)
    engine = rt.require()
    lim = limits(request)
    req = parse_chat(body, rt.defaults, lim, n_vocab=engine.model.n_vocab, n_ctx=engine.n_ctx_slot)
    fmt = select_format(rt.settings.chat_format, rt.template.source)
    # Preparing the history (JSON arguments), rendering (jinja over client-sized messages, once per
    # checkpoint hint) and tokenizing: off the event loop, like the grammar below.
    prompt = await asyncio.to_thread(
        lambda: rt.template.prompt(
            lambda text, add_special: rt.tokenize(text, add_special),
            prepare_history(req.messages),
            req.tools or None,
            req.template_kwargs,
        )
    )
    opened = opened_by(prompt.text)  # the template opened a reasoning block (Qwen3.5, Nemotron-3)
    con = await build_constraint(req, lim.schema, fmt, reasoning=opened)
    gen = generate(
        rt,
        prompt.tokens,
        req.sampling,
        grammar=con.grammar,
        checkpoint_hints=prompt.hints,
        extra_bias=_tool_call_ban(rt, fmt) if con.ban_tool_calls else None,
        endpoint="/v1/chat/completions",
        preserved=_preserved(rt, fmt),
    )
    out = ChatOutput(fmt.stream(req.tools) if con.parse_tools else None, rt.settings.reasoning_format, opened)
    meta = Meta(
        f"chatcmpl-{secrets.token_hex(12)}", "chat.completion", int(time.time()), rt.settings.model_id
    )
    if req.stream:
        return _chat_chunks(gen, req, out, meta)
    pieces: list[Piece] = []

    async def read(items: AsyncGenerator[Delta | Outcome, None]) -> AsyncGenerator[Delta | Outcome, None]:
        # The same pieces a stream would send, from the same deltas: the two cannot disagree.
        async with aclosing(items):
            async for item in items:
                if isinstance(item, Delta):
                    pieces.extend(out.feed(item.text, len(item.tokens)))
                yield item

    o = await collect(read(gen), request)
    msg = assemble(pieces + out.finish())
    message: dict[str, Any] = {"role": "assistant", "content": msg.content}
    if msg.reasoning:
        message["reasoning_content"] = msg.reasoning
    if msg.calls:
        message["tool_calls"] = [c.as_openai() for c in msg.calls]
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": "tool_calls" if msg.calls else o.finish_reason,
    }
    if o.stop_type == "word":
        choice["stopping_word"] = o.stopping_word
    return {
        **meta.head(),
        "choices": [choice],
        "usage": _chat_usage(o, out),
        "timings": o.timings,
        "id_slot": o.slot,
    }


def _chat_usage(o: Outcome, out: ChatOutput) -> dict[str, Any]:
    u = usage([o])
    u["completion_tokens_details"]["reasoning_tokens"] = out.reasoning_tokens
    return u


def _preserved(rt: Runtime, fmt: ChatFormat) -> frozenset[int]:
    """The format's tags that are single special tokens: their text must reach the output parsers."""
    ids = (rt.tokenize(tag, False) for tag in (fmt.open, fmt.close, THINK_OPEN, THINK_CLOSE))
    return frozenset(t[0] for t in ids if len(t) == 1)


def _tool_call_ban(rt: Runtime, fmt: ChatFormat) -> dict[int, float]:
    """tool_choice none: forbid the token that opens the family's call block, when it is one token
    of the vocabulary (a tag spelled in several tokens cannot be banned by a bias)."""
    ids = rt.tokenize(fmt.open, False)
    return {ids[0]: -math.inf} if len(ids) == 1 else {}


async def _chat_chunks(
    gen: AsyncGenerator[Delta | Outcome, None], req: ChatRequest, out: ChatOutput, meta: Meta
) -> AsyncGenerator[dict[str, Any], None]:
    head = {**meta.head(), "object": "chat.completion.chunk"}
    n_calls = 0

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        c = {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if req.include_usage:
            c["usage"] = None
        return c

    def pieces(parts: list[Piece]) -> list[dict[str, Any]]:
        nonlocal n_calls
        chunks = []
        for p in parts:
            if isinstance(p, str):
                if p:
                    chunks.append(chunk({"content": p}))
                continue
            if isinstance(p, Reasoning):
                if p.text:
                    chunks.append(chunk({"reasoning_content": p.text}))
                continue
            fn_head = {
                "index": n_calls,
                "id": p.id,
                "type": "function",
                "function": {"name": p.name, "arguments": ""},
            }
            chunks.append(chunk({"tool_calls": [fn_head]}))
            chunks.append(chunk({"tool_calls": [{"index": n_calls, "function": {"arguments": p.arguments}}]}))
            n_calls += 1
        return chunks

    started = False
    async with aclosing(gen) as items:
        async for item in items:
            if not started:
                started = True
                yield chunk({"role": "assistant", "content": ""})
            if isinstance(item, Delta):
                for c in pieces(out.feed(item.text, len(item.tokens))):
                    yield c
                continue
            for c in pieces(out.finish()):
                yield c
            last = chunk({}, "tool_calls" if n_calls else item.finish_reason)
            if item.stop_type == "word":
                last["choices"][0]["stopping_word"] = item.stopping_word
            last.update(timings=item.timings, id_slot=item.slot)
            yield last
            if req.include_usage:
                yield {
                    **head,
                    "choices": [],
                    "usage": _chat_usage(item, out),
                    "timings": item.timings,
                    "id_slot": item.slot,
                }


# -- completions --------------------------------------------------------------------------------
async def completions(request: Request) -> Response:
    rt = runtime(request)
    engine = rt.require()
    lim = limits(request)
    body = await read_json(request, lim.body)
    for field in ("suffix", "logprobs"):
        if body.has(field):
            raise BadRequest(f"'{field}' is not supported by this engine", param=field)
    if body.get_bool("echo", False):
        raise BadRequest("'echo' is not supported by this engine", param="echo")
    if body.get_int("n", 1) != 1 or body.get_int("best_of", 1) != 1:
        raise BadRequest("'n' and 'best_of' must be 1: send several prompts instead", param="n")
    sampling = read_sampling(body, rt.defaults, lim, n_vocab=engine.model.n_vocab, n_ctx=engine.n_ctx_slot)
    prompts = await asyncio.to_thread(_prompts, rt, body.raw("prompt"), lim, engine.n_ctx_slot)
    stream = body.get_bool("stream", False)
    options = body.get_object("stream_options")
    include_usage = options.get_bool("include_usage", False) if options else False
    meta = Meta(f"cmpl-{secrets.token_hex(12)}", "text_completion", int(time.time()), rt.settings.model_id)
    if stream:
        if len(prompts) != 1:
            raise BadRequest("streaming takes exactly one prompt", param="prompt")
        gen = generate(rt, prompts[0], sampling, endpoint="/v1/completions")
        return await start_stream(_completion_chunks(gen, meta, include_usage), done_marker=True)
    try:
        async with asyncio.TaskGroup() as tg:  # one slot per prompt; a failure cancels the others
            tasks = [
                tg.create_task(collect(generate(rt, p, sampling, endpoint="/v1/completions"), request))
                for p in prompts
            ]
    except BaseExceptionGroup as group:
        raise group.exceptions[0] from None
    outcomes = [t.result() for t in tasks]
    response: dict[str, Any] = {
        **meta.head(),
        "choices": [
            {
                "text": o.text,
                "index": i,
                "logprobs": None,
                "finish_reason": o.finish_reason,
                "timings": o.timings,
                "id_slot": o.slot,
            }
            for i, o in enumerate(outcomes)
        ],
        "usage": usage(outcomes),
    }
    if len(outcomes) == 1:
        response.update(timings=outcomes[0].timings, id_slot=outcomes[0].slot)
    return JSONResponse(response)


def _prompts(rt: Runtime, value: Any, lim: RequestLimits, n_ctx: int) -> list[list[int]]:
    """OpenAI's prompt forms: a string, strings, token ids, or arrays of token ids (bounded first;
    the route runs this in a worker thread, as it tokenizes)."""
    if value is None:
        raise BadRequest("'prompt' is required", param="prompt")
    if isinstance(value, list) and value and all(isinstance(v, str | list) for v in value):
        check_count("prompt", value, lim.max_prompts, "prompts (at most one per slot and queue place)")
        check_text("prompt", value, lim.max_text_chars)
        for i, v in enumerate(value):
            check_prompt(v, lim, n_ctx, f"prompt[{i}]")
        return [completion_prompt(rt, v, f"prompt[{i}]") for i, v in enumerate(value)]
    if isinstance(value, list) and not value:
        raise BadRequest("'prompt' is empty", param="prompt")
    if not isinstance(value, str | list):
        raise BadRequest(
            f"'prompt' must be a string, strings, token ids or arrays of token ids; got {json_type(value)}",
            param="prompt",
        )
    check_prompt(value, lim, n_ctx)
    return [completion_prompt(rt, value)]


async def _completion_chunks(
    gen: AsyncGenerator[Delta | Outcome, None], meta: Meta, include_usage: bool
) -> AsyncGenerator[dict[str, Any], None]:
    head = meta.head()

    def chunk(text: str, finish: str | None) -> dict[str, Any]:
        out = {**head, "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}
        if include_usage:
            out["usage"] = None
        return out

    async with aclosing(gen) as items:
        async for item in items:
            if isinstance(item, Delta):
                if item.text:
                    yield chunk(item.text, None)
                continue
            last = chunk("", item.finish_reason)
            last.update(timings=item.timings, id_slot=item.slot)
            yield last
            if include_usage:
                yield {**head, "choices": [], "usage": usage([item]), "timings": item.timings}


# -- models -------------------------------------------------------------------------------------
async def models(request: Request) -> Response:
    rt = runtime(request)
    entry: dict[str, Any] = {
        "id": rt.settings.model_id,
        "object": "model",
        "created": int(rt.started),
        "owned_by": "slotkeeper",
    }
    if rt.engine is not None:
        m = rt.engine.model
        entry["meta"] = {
            "arch": m.arch,
            "n_vocab": m.n_vocab,
            "n_ctx_train": m.n_ctx_train,
            "n_embd": m.n_embd,
            "n_params": m.n_params,
            "size": m.size_bytes,
            "hybrid": m.hybrid,
            "recurrent": m.recurrent,
            "fingerprint": m.fingerprint,
        }
    return JSONResponse({"object": "list", "data": [entry]})


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/models", models, methods=["GET"]),
]

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
from .chat_request import ChatRequest, Constraint, build_constraint, parse_chat
from .generation import Delta, Outcome, collect, generate
from .limits import RequestLimits, check_count, check_text
from .routes_llama import check_prompt, completion_prompt, limits, runtime
from .runtime import Runtime
from .sampling import read_sampling
from .sse import start_stream
from .tool_calls import OPEN, ToolCall, ToolCallStream, parse_tool_calls


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


async def run_chat(
    request: Request, body: Body
) -> dict[str, Any] | AsyncGenerator[dict[str, Any], None]:
    """One chat completion from a parsed body: the response object, or (`stream`) its chunks.

    The Responses and Messages routes call this with a body translated from their own shapes and
    translate what comes back, so every API shares one chat path (templates, formats, grammars).
    """
    rt = runtime(request)
    engine = rt.require()
    lim = limits(request)
    req = parse_chat(body, rt.defaults, lim, n_vocab=engine.model.n_vocab, n_ctx=engine.n_ctx_slot)
    con = await build_constraint(req, lim.schema)
    # Rendering (jinja over client-sized messages, once per checkpoint hint) and tokenizing: off the
    # event loop, like the grammar above.
    prompt = await asyncio.to_thread(
        rt.template.prompt,
        lambda text, add_special: rt.tokenize(text, add_special),
        req.messages,
        req.tools or None,
        req.template_kwargs,
    )
    gen = generate(
        rt,
        prompt.tokens,
        req.sampling,
        grammar=con.grammar,
        checkpoint_hints=prompt.hints,
        extra_bias=_tool_call_ban(rt) if con.ban_tool_calls else None,
        endpoint="/v1/chat/completions",
    )
    meta = Meta(
        f"chatcmpl-{secrets.token_hex(12)}", "chat.completion", int(time.time()), rt.settings.model_id
    )
    if req.stream:
        return _chat_chunks(gen, req, con, meta)
    o = await collect(gen, request)
    content, calls = parse_tool_calls(o.text) if con.parse_tools else (o.text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.as_openai() for c in calls]
    return {
        **meta.head(),
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": "tool_calls" if calls else o.finish_reason,
            }
        ],
        "usage": usage([o]),
        "timings": o.timings,
        "id_slot": o.slot,
    }


def _tool_call_ban(rt: Runtime) -> dict[int, float]:
    """tool_choice none: forbid the `<tool_call>` token when it is one token of the vocabulary."""
    ids = rt.tokenize(OPEN, False)
    return {ids[0]: -math.inf} if len(ids) == 1 else {}


async def _chat_chunks(
    gen: AsyncGenerator[Delta | Outcome, None], req: ChatRequest, con: Constraint, meta: Meta
) -> AsyncGenerator[dict[str, Any], None]:
    head = {**meta.head(), "object": "chat.completion.chunk"}
    calls = ToolCallStream() if con.parse_tools else None
    n_calls = 0

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        out = {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if req.include_usage:
            out["usage"] = None
        return out

    def pieces(parts: list[str | ToolCall]) -> list[dict[str, Any]]:
        nonlocal n_calls
        out = []
        for p in parts:
            if isinstance(p, str):
                if p:
                    out.append(chunk({"content": p}))
                continue
            fn_head = {
                "index": n_calls,
                "id": p.id,
                "type": "function",
                "function": {"name": p.name, "arguments": ""},
            }
            out.append(chunk({"tool_calls": [fn_head]}))
            out.append(chunk({"tool_calls": [{"index": n_calls, "function": {"arguments": p.arguments}}]}))
            n_calls += 1
        return out

    started = False
    async with aclosing(gen) as items:
        async for item in items:
            if not started:
                started = True
                yield chunk({"role": "assistant", "content": ""})
            if isinstance(item, Delta):
                for c in pieces(calls.feed(item.text) if calls else [item.text]):
                    yield c
                continue
            for c in pieces(calls.finish() if calls else []):
                yield c
            last = chunk({}, "tool_calls" if n_calls else item.finish_reason)
            last.update(timings=item.timings, id_slot=item.slot)
            yield last
            if req.include_usage:
                yield {
                    **head,
                    "choices": [],
                    "usage": usage([item]),
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

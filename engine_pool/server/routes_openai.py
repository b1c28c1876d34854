"""OpenAI-compatible endpoints: /v1/chat/completions (+ /input_tokens), /v1/completions, /v1/models.

Responses follow the OpenAI API as the official SDK parses it, plus llama-server's extras: `timings`
(numbers only) on responses and on the last stream chunk, `id_slot` (which slot served the request),
and `usage.prompt_tokens_details.cached_tokens` = the prompt tokens actually reused (timings.cache_n,
restored ones included). Beside `timings`, `slotkeeper` says how the prefix was served (reuse kind,
restored). `n` choices run as separate decode runs at once, each on a slot of its own (or queued
for one), like a batch of prompts; their prompt counts once in `usage`. `logprobs` come from the
raw logits, streamed with the chunks their tokens made.

The edges only: a chat runs in `chat_pipeline` (which the Responses, Messages and Vertex routes
share), prompts are bounded and tokenized by `completion_prompts`, and answers take their shapes in
`openai_answer`.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine_pool.errors import BadRequest
from engine_pool.http.body import read_json

from ..protocol.engine_answers import TextCompletion
from ..protocol.sse import start_stream
from .chat_pipeline import chat_prompt, run_chat
from .chat_request import parse_chat
from .completion_prompts import check_prompts, completion_prompt, prompt_field
from .completion_result import prompt_text, verbose_result
from .decoding import collect_all, completion_logprobs, decode_on_slot, token_pieces, with_biases
from .openai_answer import Meta, completion_chunks, extras, usage
from .route_context import aliased, limits, limits_and_body, runtime
from .sampling import read_sampling


# -- chat ---------------------------------------------------------------------------------------
async def chat_completions(request: Request) -> Response:
    body = await read_json(request, limits(request).body)
    result = await run_chat(request, body)
    if isinstance(result, dict):
        return JSONResponse(result)
    return await start_stream(result, done_marker=True)


async def chat_input_tokens(request: Request) -> Response:
    """llama-server's `POST /chat/completions/input_tokens`: `{"input_tokens": n}`, the prompt a chat
    request would evaluate (template, tools, prefill), counted without generating; with
    `"with_tokens": true` also `"tokens"`, the ids themselves (the gateway restores a session for
    them: a prompt that leaves it early needs only the part up to its checkpoint)."""
    rt = runtime(request)
    engine = rt.require()
    lim, body = await limits_and_body(request)
    req = parse_chat(body, rt.defaults, lim, n_vocab=engine.model.n_vocab, n_ctx=engine.n_ctx_slot)
    prompt, _ = await asyncio.to_thread(chat_prompt, rt, req)
    if body.get_bool("with_tokens", False):
        return JSONResponse({"input_tokens": len(prompt.tokens), "tokens": prompt.tokens})
    return JSONResponse({"input_tokens": len(prompt.tokens)})


# -- completions --------------------------------------------------------------------------------
async def completions(request: Request) -> Response:
    rt = runtime(request)
    engine = rt.require()
    lim, body = await limits_and_body(request)
    if body.has("suffix"):
        raise BadRequest("'suffix' is not supported by this engine", param="suffix")
    if body.get_bool("echo", False):
        raise BadRequest("'echo' is not supported by this engine", param="echo")
    if body.get_int("best_of", 1) != 1:
        raise BadRequest("'best_of' must be 1: ask for 'n' choices instead", param="best_of")
    if body.raw("prompt") is None:
        raise BadRequest("'prompt' is required", param="prompt")
    n = body.get_int("n", 1, lo=1, hi=lim.max_generations)
    prompts = check_prompts(body.raw("prompt"), lim, engine.n_ctx_slot, n)
    stream = body.get_bool("stream", False)
    if stream and len(prompts) * n > 1:
        raise BadRequest("streaming takes exactly one prompt and 'n' 1", param="prompt" if n == 1 else "n")
    sampling = read_sampling(body, rt.defaults, lim, n_vocab=engine.model.n_vocab, n_ctx=engine.n_ctx_slot)
    # OpenAI's `logprobs: N` (llama-server: n_probs, unless n_probs itself was sent).
    top = (
        body.get_int("logprobs", sampling.n_probs, lo=0, hi=lim.max_n_probs) if body.has("logprobs") else None
    )
    if top is None and sampling.n_probs:
        top = sampling.n_probs
    if top is not None:
        sampling = replace(sampling, n_probs=max(top, 1))  # the core reports none at 0
    tokens = await asyncio.to_thread(
        lambda: [completion_prompt(rt, p, prompt_field(prompts, i)) for i, p in enumerate(prompts)]
    )
    sampling = await with_biases(rt, sampling)
    options = body.get_object("stream_options")
    include_usage = options.get_bool("include_usage", False) if options else False
    meta = Meta(f"cmpl-{secrets.token_hex(12)}", "text_completion", int(time.time()), rt.settings.model_id)
    pieces = token_pieces(engine)
    if stream:
        gen = decode_on_slot(rt, tokens[0], sampling, endpoint="/v1/completions")
        chunks = completion_chunks(gen, meta, include_usage, top, pieces, sampling.timings_per_token)
        return await start_stream(chunks, done_marker=True)
    runs = [p for p in tokens for _ in range(n)]  # OpenAI's order: the choices of each prompt together
    outcomes = await collect_all(
        [decode_on_slot(rt, p, sampling, endpoint="/v1/completions") for p in runs], request
    )
    response: TextCompletion = {
        **meta.head(),
        "choices": [
            {
                "text": o.text,
                "index": i,
                "logprobs": None if top is None else completion_logprobs(o.probs, pieces, top),
                "finish_reason": o.finish_reason,
                **extras(o),
            }
            for i, o in enumerate(outcomes)
        ],
        "usage": usage(outcomes, n),
    }
    if len(outcomes) == 1:
        response.update(extras(outcomes[0]))
    if body.get_bool("verbose", False) or rt.settings.verbose:  # llama-server's `__verbose`: the first
        text = await asyncio.to_thread(prompt_text, engine, tokens[0])
        response["__verbose"] = verbose_result(rt, outcomes[0], sampling, text, pieces)
    return JSONResponse(response)


# -- models -------------------------------------------------------------------------------------
async def models(request: Request) -> Response:
    rt = runtime(request)
    entry: dict[str, Any] = {
        "id": rt.settings.model_id,
        # llama-server's shape: every --alias is a name clients may use; --tags are informational.
        "aliases": list(rt.settings.aliases),
        "tags": list(rt.settings.model_tags),
        "object": "model",
        "created": int(rt.started),
        "owned_by": "slotkeeper",
        "role": rt.settings.role,  # prefill | decode | mixed (engine_pool.protocol.handoff)
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
    *aliased(chat_completions, ["POST"], "/v1/chat/completions", "/chat/completions"),
    *aliased(
        chat_input_tokens, ["POST"], "/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"
    ),
    Route("/v1/completions", completions, methods=["POST"]),
    *aliased(models, ["GET"], "/v1/models", "/models"),
]

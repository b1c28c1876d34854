"""llama-server's own endpoints: health, props, slots, completion, (de)tokenize, apply-template, metrics.

Request and response fields follow llama-server's documentation; additions (checkpoint counts, how
a prefix was reused) are extra fields a llama-server client ignores.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import native

from ..body import check_tokens, json_type, read_json
from ..errors import BadRequest, ContextSizeExceeded, NotFound, ServerError, Unavailable, error_payload
from . import slot_files
from .chat_request import parse_messages, parse_tools
from .gbnf import check_grammar
from .generation import Delta, Outcome, collect, generate
from .grammar import built_off_loop, schema_grammar
from .limits import RequestLimits, check_count, check_text
from .metrics import CONTENT_TYPE
from .runtime import Runtime
from .sampling import Sampling, generation_settings, read_sampling
from .sse import start_stream


def runtime(request: Request) -> Runtime:
    rt: Runtime = request.app.state.runtime
    return rt


def limits(request: Request) -> RequestLimits:
    """The engine's request limits, built once from its settings by `app.build_app`."""
    lim: RequestLimits = request.app.state.limits
    return lim


async def health(request: Request) -> Response:
    rt = runtime(request)
    if rt.state == "ready":
        return JSONResponse({"status": "ok"})
    if rt.state == "failed":
        return JSONResponse(error_payload(ServerError(rt.error)), status_code=500)
    err = Unavailable(
        "Loading model" if rt.state == "loading" else "the engine is shutting down",
        retry_after=rt.settings.retry_after_s,
    )
    return JSONResponse(error_payload(err), status_code=503, headers={"Retry-After": str(err.retry_after)})


async def props(request: Request) -> Response:
    rt = runtime(request)
    engine = rt.require()
    m = engine.model
    return JSONResponse(
        {
            "default_generation_settings": {
                "id": 0,
                "id_task": -1,
                "n_ctx": engine.n_ctx_slot,
                "params": generation_settings(rt.defaults),
            },
            "total_slots": rt.settings.n_slots,
            "model_alias": rt.settings.model_id,
            "model_path": rt.settings.model,
            "modalities": {"vision": False, "audio": False},
            "chat_template": rt.template.source,  # the one in use (flags, GGUF, or ChatML fallback)
            "bos_token": rt.token_text(m.bos),
            "eos_token": rt.token_text(m.eos),
            "build_info": f"slotkeeper {native.ENGINE_VERSION} / {native.LLAMA_BUILD}",
            "is_sleeping": False,
            "slotkeeper": {
                "arch": m.arch,
                "hybrid": m.hybrid,
                "recurrent": m.recurrent,
                "n_swa": m.n_swa,
                "fingerprint": m.fingerprint,
                "chat_template_origin": rt.template.origin,
                "state_seq_version": native.STATE_SEQ_VERSION,
                "slot_save_path": str(rt.slot_dir) if rt.slot_dir else None,
                "n_ctx": rt.settings.n_ctx,
                "max_checkpoints": rt.settings.max_checkpoints,
                "checkpoint_interval": rt.settings.checkpoint_interval,
                "checkpoint_min_step": rt.settings.checkpoint_min_step,
            },
        }
    )


async def slots(request: Request) -> Response:
    rt = runtime(request)
    engine = rt.require()
    infos = await asyncio.to_thread(engine.slots)
    sched = rt.scheduler
    out = [
        {
            "id": s.id,
            "id_task": s.request_id,
            "n_ctx": engine.n_ctx_slot,
            "is_processing": s.busy or sched.busy(s.id),
            "lease": sched.purpose(s.id) or None,
            "queued": sched.waiting_for(s.id),
            "n_tokens": s.n_tokens,
            "n_checkpoints": s.n_checkpoints,
            "checkpoint_bytes": s.checkpoint_bytes,
            "restored": s.restored,
        }
        for s in infos
    ]
    if request.query_params.get("fail_on_no_slot") and all(s["is_processing"] for s in out):
        raise Unavailable("no slot available", retry_after=rt.settings.retry_after_s)
    return JSONResponse(out)


_SLOT_ACTIONS = ("save", "restore", "erase")


async def slot_action(request: Request) -> Response:
    rt = runtime(request)
    rt.require()
    raw_id = request.path_params["id_slot"]
    if not raw_id.isdigit() or int(raw_id) >= rt.settings.n_slots:
        raise NotFound(f"slot {raw_id!r} does not exist (this engine has slots 0..{rt.settings.n_slots - 1})")
    slot = int(raw_id)
    action = request.query_params.get("action")
    if action not in _SLOT_ACTIONS:
        raise BadRequest(
            f"query parameter 'action' must be one of {', '.join(_SLOT_ACTIONS)}; got {action!r}",
            param="action",
        )
    if action == "erase":
        return JSONResponse(await slot_files.erase(rt, slot))
    body = await read_json(request, limits(request).body)
    if action == "save":
        return JSONResponse(await slot_files.save(rt, slot, body.raw("filename")))
    return JSONResponse(await slot_files.restore(rt, slot, body.raw("filename")))


def completion_prompt(rt: Runtime, value: Any, where: str = "prompt") -> list[int]:
    """One prompt: text, token ids, or llama-server's mix of both (text pieces are tokenized in place).

    Routes check its size first (`check_prompt`) and run this in a worker thread: tokenizing takes
    about a microsecond per character. (The native tokenizer still holds the GIL, so for now the
    loop waits all the same; the bound is what keeps that short.)"""
    n_vocab = rt.require().model.n_vocab
    if isinstance(value, str):
        tokens = rt.tokenize(value, True)
    elif isinstance(value, list) and all(
        isinstance(v, str) or isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        tokens = []
        for i, v in enumerate(value):
            tokens += (
                rt.tokenize(v, i == 0) if isinstance(v, str) else check_tokens([v], n_vocab, f"{where}[{i}]")
            )
    else:
        raise BadRequest(
            f"'{where}' must be a string, an array of token ids, or a mix of both; got {json_type(value)}",
            param=where,
        )
    if not tokens:
        raise BadRequest(f"'{where}' is empty", param=where)
    return tokens


def check_prompt(value: Any, lim: RequestLimits, n_ctx: int, where: str = "prompt") -> None:
    """Bound a prompt (or a batch of them) before anything tokenizes it: its text against
    --max-text-chars, its token ids against a slot's context (every id is one token)."""
    check_text(where, value, lim.max_text_chars)
    if isinstance(value, list):
        n_ids = sum(1 for v in value if isinstance(v, int))
        if n_ids >= n_ctx:
            raise ContextSizeExceeded(n_ids, n_ctx)


async def completion(request: Request) -> Response:
    rt = runtime(request)
    engine = rt.require()
    lim = limits(request)
    body = await read_json(request, lim.body)
    if not body.has("prompt"):
        raise BadRequest("'prompt' is required", param="prompt")
    # Cheap checks first: a refused request must not cost a tokenization or a grammar build.
    check_prompt(body.raw("prompt"), lim, engine.n_ctx_slot)
    sampling = read_sampling(body, rt.defaults, lim, n_vocab=engine.model.n_vocab, n_ctx=engine.n_ctx_slot)
    grammar = body.get_str("grammar", "") or ""
    check_grammar(grammar, lim.max_grammar_bytes, lim.max_grammar_depth)
    if body.has("json_schema"):
        schema = body.raw("json_schema")
        grammar = await built_off_loop(
            "json_schema", lambda: schema_grammar(schema, "json_schema", lim.schema), lambda g: g
        )
    prompt = await asyncio.to_thread(completion_prompt, rt, body.raw("prompt"))
    gen = generate(rt, prompt, sampling, grammar=grammar, endpoint="/completion")
    if body.get_bool("stream", False):
        return await start_stream(_completion_chunks(rt, gen, sampling), done_marker=False)
    outcome = await collect(gen, request)
    return JSONResponse(_completion_final(rt, outcome, sampling, streamed=False))


async def _completion_chunks(
    rt: Runtime, gen: AsyncGenerator[Delta | Outcome, None], sampling: Sampling
) -> AsyncGenerator[dict[str, Any], None]:
    async with aclosing(gen) as items:
        async for item in items:
            if isinstance(item, Delta):
                yield {"index": 0, "content": item.text, "tokens": item.tokens, "stop": False}
            else:
                yield _completion_final(rt, item, sampling, streamed=True)


def _completion_final(rt: Runtime, o: Outcome, sampling: Sampling, *, streamed: bool) -> dict[str, Any]:
    """The whole result, or (streamed) the last chunk: everything but the text and tokens already sent."""
    return {
        "index": 0,
        "content": "" if streamed else o.text,
        "tokens": [] if streamed else o.tokens,
        "id_slot": o.slot,
        "stop": True,
        "model": rt.settings.model_id,
        "tokens_predicted": o.n_predicted,
        "tokens_evaluated": o.n_prompt,
        "generation_settings": generation_settings(sampling),
        "has_new_line": "\n" in o.text,
        "truncated": False,
        "stop_type": o.stop_type,
        "stopping_word": o.stopping_word,
        "tokens_cached": o.n_prompt + max(o.n_predicted - 1, 0),
        "timings": o.timings,
    }


async def tokenize(request: Request) -> Response:
    rt = runtime(request)
    engine = rt.require()
    lim = limits(request)
    body = await read_json(request, lim.body)
    content = body.get_str("content")
    if content is None:
        raise BadRequest("'content' is required and must be a string", param="content")
    check_text("content", content, lim.max_text_chars)
    tokens = await asyncio.to_thread(
        engine.tokenize, content, body.get_bool("add_special", False), body.get_bool("parse_special", True)
    )
    if not body.get_bool("with_pieces", False):
        return JSONResponse({"tokens": tokens})
    pieces = []
    for t in tokens:
        raw = engine.raw.token_piece(t, True)
        try:
            piece: str | list[int] = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        pieces.append({"id": t, "piece": piece})
    return JSONResponse({"tokens": pieces})


async def detokenize(request: Request) -> Response:
    rt = runtime(request)
    engine = rt.require()
    lim = limits(request)
    body = await read_json(request, lim.body)
    raw = body.get_list("tokens")
    if raw is None:
        raise BadRequest("'tokens' is required (an array of token ids)", param="tokens")
    check_count("tokens", raw, lim.max_text_chars, "tokens")  # a token is at least a character
    tokens = check_tokens(raw, engine.model.n_vocab, "tokens")
    return JSONResponse({"content": await asyncio.to_thread(engine.detokenize, tokens)})


async def apply_template(request: Request) -> Response:
    rt = runtime(request)
    rt.require()
    lim = limits(request)
    body = await read_json(request, lim.body)
    kwargs = body.get_object("chat_template_kwargs")
    messages, tools = parse_messages(body, lim), parse_tools(body, lim)
    # Rendering runs a client-sized loop in jinja: off the event loop.
    text = await asyncio.to_thread(
        rt.template.render,
        messages,
        tools or None,
        add_generation_prompt=body.get_bool("add_generation_prompt", True),
        kwargs=dict(kwargs.data) if kwargs else None,
    )
    return JSONResponse({"prompt": text})


async def metrics(request: Request) -> Response:
    return Response(runtime(request).metrics.render(), media_type=CONTENT_TYPE)


ROUTES = [
    Route("/health", health, methods=["GET"]),
    Route("/v1/health", health, methods=["GET"]),
    Route("/props", props, methods=["GET"]),
    Route("/slots", slots, methods=["GET"]),
    Route("/slots/{id_slot}", slot_action, methods=["POST"]),
    Route("/completion", completion, methods=["POST"]),
    Route("/completions", completion, methods=["POST"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/apply-template", apply_template, methods=["POST"]),
    Route("/metrics", metrics, methods=["GET"]),
]

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
from engine_pool.errors import BadRequest, NotFound, NotSupported, ServerError, Unavailable, error_payload
from engine_pool.http.body import Body, check_tokens, read_json

from ..protocol.bounds import check_count
from ..protocol.engine_answers import LlamaChunk, LlamaCompletion
from ..protocol.slot_actions import SlotCancelled
from ..protocol.sse import start_stream
from . import slot_files
from .chat_request import continuation, parse_messages, parse_tools, prefill_text
from .completion_prompts import check_prompts, completion_prompt, prompt_field
from .completion_result import completion_result, prompt_text, response_fields, select_fields
from .decoding import (
    Decoded,
    Delta,
    TokenBytes,
    collect_all,
    decode_on_slot,
    probs_json,
    token_pieces,
    with_biases,
)
from .gbnf import check_grammar
from .grammar import built_off_loop, schema_grammar
from .limits import check_text
from .metrics import CONTENT_TYPE
from .progress import Progress
from .route_context import aliased, limits, limits_and_body, runtime
from .runtime import Runtime
from .sampling import Sampling, generation_settings, read_label, read_sampling


async def health(request: Request) -> Response:
    rt = runtime(request)
    if rt.state == "ready":
        return JSONResponse({"status": "ok"})
    if rt.state == "failed":
        return JSONResponse(error_payload(ServerError(rt.error)), status_code=500)
    loading = rt.state == "loading"
    why = "Loading model" if loading else "the engine is shutting down"
    err = Unavailable(why, retry_after=rt.settings.retry_after_s)
    body = error_payload(err)
    if loading:  # beside llama-server's body: how far the weights are, for the supervisor's console line
        body["progress"] = round(rt.load_progress, 2)
    return JSONResponse(body, status_code=503, headers={"Retry-After": str(err.retry_after)})


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
            "endpoint_slots": not rt.settings.no_slots,
            "endpoint_props": False,  # POST /props (changing global properties) is not served
            "endpoint_metrics": rt.settings.metrics,
            "slotkeeper": {
                "arch": m.arch,
                "hybrid": m.hybrid,
                "recurrent": m.recurrent,
                "n_swa": m.n_swa,
                "fingerprint": m.fingerprint,
                "chat_template_origin": rt.template.origin,
                "aliases": list(rt.settings.aliases),
                "tags": list(rt.settings.model_tags),
                "state_seq_version": native.STATE_SEQ_VERSION,
                "slot_save_path": str(rt.slot_dir) if rt.slot_dir else None,
                "n_ctx": rt.settings.n_ctx,
                "max_checkpoints": rt.settings.max_checkpoints,
                "checkpoint_interval": rt.settings.checkpoint_interval,
                "checkpoint_min_step": rt.settings.checkpoint_min_step,
            },
        }
    )


# llama-server's messages for the endpoints a flag turns off (501, not_supported_error).
NO_SLOTS = "This server does not support slots endpoint. Start it with `--slots`"
NO_METRICS = "This server does not support metrics endpoint. Start it with `--metrics`"


async def slots(request: Request) -> Response:
    rt = runtime(request)
    if rt.settings.no_slots:
        raise NotSupported(NO_SLOTS)
    engine = rt.require()
    infos = await asyncio.to_thread(engine.slots)
    leases = rt.leases
    out = [
        {
            "id": s.id,
            "id_task": s.request_id,
            "n_ctx": engine.n_ctx_slot,
            "is_processing": s.busy or leases.busy(s.id),
            "lease": leases.purpose(s.id) or None,
            "queued": leases.waiting_for(s.id),
            "n_tokens": s.n_tokens,
            "n_checkpoints": s.n_checkpoints,
            "checkpoint_bytes": s.checkpoint_bytes,
            "restored": s.restored,
            **_labelled(leases.label_of(s.id)),
        }
        for s in infos
    ]
    if request.query_params.get("fail_on_no_slot") and all(s["is_processing"] for s in out):
        raise Unavailable("no slot available", retry_after=rt.settings.retry_after_s)
    return JSONResponse(out)


def _labelled(label: tuple[str, str] | None) -> dict[str, str]:
    """A slot's `owner` and `session` (the gateway's names for whose state it holds), when known."""
    return {"owner": label[0], "session": label[1]} if label is not None else {}


_SLOT_ACTIONS = ("save", "restore", "erase", "cancel")


def _named(body: Body, field: str) -> tuple[str, str] | None:
    """`slot_owner` and `field` (ours: llama-server has neither): a save's `slot_expect`, whose
    state the caller means to save; a restore's `slot_session`, whose state it loads (the slot's
    label after it). None when the body names nobody."""
    owner, session = read_label(body, "slot_owner"), read_label(body, field)
    if bool(owner) != bool(session):
        raise BadRequest(f"'slot_owner' and '{field}' go together", param=field)
    return (owner, session) if owner else None


async def slot_action(request: Request) -> Response:
    rt = runtime(request)
    if rt.settings.no_slots:  # llama-server gates only GET /slots; a node never passes --no-slots
        raise NotSupported(NO_SLOTS)
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
        return JSONResponse((await slot_files.erase(rt, slot)).to_json())
    if action == "cancel":  # (ours: llama-server has no way to stop a slot's request but its client)
        return JSONResponse(SlotCancelled(slot, await rt.cancel_slot(slot)).to_json())
    body = await read_json(request, limits(request).body)
    if action == "save":
        # `durable` (ours): false for a file read once on this node and deleted (a handoff's): no
        # sync to disk before it is renamed into place.
        durable = body.get_bool("durable", True)
        saved = await slot_files.save(rt, slot, body.raw("filename"), _named(body, "slot_expect"), durable)
        return JSONResponse(saved.to_json())
    restored = await slot_files.restore(rt, slot, body.raw("filename"), _named(body, "slot_session"))
    return JSONResponse(restored.to_json())


async def completion(request: Request) -> Response:
    rt = runtime(request)
    engine = rt.require()
    lim, body = await limits_and_body(request)
    if not body.has("prompt"):
        raise BadRequest("'prompt' is required", param="prompt")
    # Cheap checks first: a refused request must not cost a tokenization or a grammar build.
    n_cmpl = body.get_int("n_cmpl", 1, lo=1, hi=lim.max_generations)
    prompts = check_prompts(body.raw("prompt"), lim, engine.n_ctx_slot, n_cmpl)
    stream = body.get_bool("stream", False)
    if stream and len(prompts) * n_cmpl > 1:
        raise BadRequest("streaming takes exactly one prompt and one completion (n_cmpl 1)", param="prompt")
    sampling = read_sampling(body, rt.defaults, lim, n_vocab=engine.model.n_vocab, n_ctx=engine.n_ctx_slot)
    fields = response_fields(body, lim)
    grammar = body.get_str("grammar", "") or ""
    check_grammar(grammar, lim.max_grammar_bytes, lim.max_grammar_depth)
    if body.has("json_schema"):
        if grammar:  # llama-server would drop the schema silently
            raise BadRequest("Cannot use both json_schema and grammar", param="json_schema")
        schema = body.raw("json_schema")
        grammar = await built_off_loop(
            "json_schema", lambda: schema_grammar(schema, "json_schema", lim.schema), lambda g: g
        )
    tokens = await asyncio.to_thread(
        lambda: [completion_prompt(rt, p, prompt_field(prompts, i)) for i, p in enumerate(prompts)]
    )
    sampling = await with_biases(rt, sampling)
    pieces = token_pieces(engine)
    texts = await asyncio.to_thread(lambda: [prompt_text(engine, p) for p in tokens])
    if stream:
        gen = decode_on_slot(rt, tokens[0], sampling, grammar=grammar, endpoint="/completion")
        chunks = _completion_chunks(rt, gen, sampling, pieces, fields, texts[0])
        return await start_stream(chunks, done_marker=False)
    runs = [i for i in range(len(tokens)) for _ in range(n_cmpl)]
    outcomes = await collect_all(
        [decode_on_slot(rt, tokens[i], sampling, grammar=grammar, endpoint="/completion") for i in runs],
        request,
    )
    results = [
        _cut(completion_result(rt, o, sampling, pieces, texts[runs[i]], streamed=False, index=i), fields)
        for i, o in enumerate(outcomes)
    ]
    return JSONResponse(results[0] if len(results) == 1 else results)


async def _completion_chunks(
    rt: Runtime,
    gen: AsyncGenerator[Decoded, None],
    sampling: Sampling,
    pieces: TokenBytes,
    fields: list[str],
    prompt: str,
) -> AsyncGenerator[LlamaChunk | LlamaCompletion | dict[str, Any], None]:
    async with aclosing(gen) as items:
        async for item in items:
            if isinstance(item, Progress):
                report: LlamaChunk = {"index": 0, "content": "", "tokens": [], "stop": False}
                if sampling.timings_per_token:
                    report["timings"] = item.timings
                report["prompt_progress"] = item.to_json()
                yield report
            elif isinstance(item, Delta):
                chunk: LlamaChunk = {
                    "index": 0,
                    "content": item.text,
                    "tokens": item.tokens,
                    "stop": False,
                }
                if item.probs:
                    chunk["completion_probabilities"] = probs_json(item.probs, pieces)
                if item.timings is not None:
                    chunk["timings"] = item.timings
                yield chunk
            else:
                yield _cut(completion_result(rt, item, sampling, pieces, prompt, streamed=True), fields)


def _cut(result: LlamaCompletion, fields: list[str]) -> LlamaCompletion | dict[str, Any]:
    """`result` cut down to the request's `response_fields`, when it named some."""
    return select_fields(result, fields) if fields else result


async def tokenize(request: Request) -> Response:
    engine = runtime(request).require()
    lim, body = await limits_and_body(request)
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
    engine = runtime(request).require()
    lim, body = await limits_and_body(request)
    raw = body.get_list("tokens")
    if raw is None:
        raise BadRequest("'tokens' is required (an array of token ids)", param="tokens")
    check_count("tokens", raw, lim.max_text_chars, "tokens")  # a token is at least a character
    tokens = check_tokens(raw, engine.model.n_vocab, "tokens")
    return JSONResponse({"content": await asyncio.to_thread(engine.detokenize, tokens)})


async def apply_template(request: Request) -> Response:
    rt = runtime(request)
    rt.require()
    lim, body = await limits_and_body(request)
    kwargs = body.get_object("chat_template_kwargs")
    messages, tools = parse_messages(body, lim), parse_tools(body, lim)
    cont, generation_prompt = continuation(
        messages, body.get_bool("add_generation_prompt", True), body.raw("continue_final_message")
    )

    def render() -> str:  # a client-sized loop in jinja: off the event loop
        extra = dict(kwargs.data) if kwargs else None
        if cont:  # llama-server's prefill: the last (assistant) message is continued
            head = rt.template.render(messages[:-1], tools or None, add_generation_prompt=True, kwargs=extra)
            return head + prefill_text(messages[-1])
        return rt.template.render(
            messages, tools or None, add_generation_prompt=generation_prompt, kwargs=extra
        )

    return JSONResponse({"prompt": await asyncio.to_thread(render)})


async def metrics(request: Request) -> Response:
    rt = runtime(request)
    if not rt.settings.metrics:
        raise NotSupported(NO_METRICS)
    engine = rt.engine  # (slots run requests in the core until their last event: llama-server's count)
    processing = sum(s.busy for s in await asyncio.to_thread(engine.slots)) if engine is not None else 0
    # llama-server's header: when this process started (unix seconds). (uvicorn writes header names
    # in lower case, as HTTP allows: a client that looks names up case-sensitively misses it.)
    started = {"Process-Start-Time-Unix": str(int(rt.started))}
    return Response(rt.metrics.render(processing), media_type=CONTENT_TYPE, headers=started)


ROUTES = [
    *aliased(health, ["GET"], "/health", "/v1/health"),
    Route("/props", props, methods=["GET"]),
    Route("/slots", slots, methods=["GET"]),
    Route("/slots/{id_slot}", slot_action, methods=["POST"]),
    *aliased(completion, ["POST"], "/completion", "/completions"),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/apply-template", apply_template, methods=["POST"]),
    Route("/metrics", metrics, methods=["GET"]),
]

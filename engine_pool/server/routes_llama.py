"""llama-server's own endpoints: health, props, slots, completion, (de)tokenize, apply-template, metrics.

Request and response fields follow llama-server's documentation; additions (checkpoint counts, how
a prefix was reused) are extra fields a llama-server client ignores.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import native

from ..common.body import Body, check_tokens, json_type, read_json
from ..common.errors import (
    BadRequest,
    ContextSizeExceeded,
    NotFound,
    NotSupported,
    ServerError,
    Unavailable,
    error_payload,
)
from ..protocol.bounds import check_count, too_many
from ..protocol.sse import start_stream
from . import slot_files
from .chat_request import continuation, parse_messages, parse_tools, prefill_text
from .decoding import Delta, Outcome, TokenBytes, collect_all, decode_on_slot, probs_json, with_biases
from .gbnf import check_grammar
from .grammar import built_off_loop, schema_grammar
from .limits import RequestLimits, check_text
from .metrics import CONTENT_TYPE
from .runtime import Runtime
from .sampling import Sampling, generation_settings, read_label, read_sampling

Endpoint = Callable[[Request], Awaitable[Response]]


def runtime(request: Request) -> Runtime:
    rt: Runtime = request.app.state.runtime
    return rt


def limits(request: Request) -> RequestLimits:
    """The engine's request limits, built once from its settings by `app.build_app`."""
    lim: RequestLimits = request.app.state.limits
    return lim


async def limits_and_body(request: Request) -> tuple[RequestLimits, Body]:
    """The engine's request limits and the request's JSON body, read within them."""
    lim = limits(request)
    return lim, await read_json(request, lim.body)


def aliased(endpoint: Endpoint, methods: list[str], *paths: str) -> list[Route]:
    """`endpoint` at each of `paths`: llama-server answers much of its API under two names (`/health`
    and `/v1/health`, `/completion` and `/completions`)."""
    return [Route(path, endpoint, methods=methods) for path in paths]


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
        return JSONResponse(await slot_files.erase(rt, slot))
    if action == "cancel":  # (ours: llama-server has no way to stop a slot's request but its client)
        return JSONResponse({"id_slot": slot, "cancelled": await rt.cancel_slot(slot)})
    body = await read_json(request, limits(request).body)
    if action == "save":
        return JSONResponse(
            await slot_files.save(rt, slot, body.raw("filename"), _named(body, "slot_expect"))
        )
    return JSONResponse(
        await slot_files.restore(rt, slot, body.raw("filename"), _named(body, "slot_session"))
    )


def split_prompts(value: Any) -> list[Any]:
    """llama-server's prompt forms: an array that holds no token id at its top level is several
    prompts (strings, arrays of token ids, mixes, `{"prompt_string": ...}` objects); anything else
    is one prompt."""
    if isinstance(value, list) and not any(_is_id(v) for v in value):
        if not value:
            raise BadRequest("'prompt' must not be empty", param="prompt")
        return list(value)
    return [value]


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_prompts(value: Any, lim: RequestLimits, n_ctx: int, n: int = 1) -> list[Any]:
    """The prompts `value` holds (`split_prompts`), bounded before anything tokenizes them: their
    number (times `n` choices each) against what the engine can run at once, their text against
    --max-text-chars, each one's token ids against a slot's context."""
    prompts = split_prompts(value)
    check_text("prompt", value, lim.max_text_chars)
    if len(prompts) * n > lim.max_generations:
        if n == 1:
            raise too_many(
                "prompt", len(prompts), lim.max_generations, "prompts (at most one per slot and queue place)"
            )
        raise too_many(
            "prompt",
            len(prompts) * n,
            lim.max_generations,
            f"generations at {n} choices a prompt (one per slot and queue place)",
        )
    for i, p in enumerate(prompts):
        check_prompt(p, lim, n_ctx, prompt_field(prompts, i))
    return prompts


def prompt_field(prompts: list[Any], i: int) -> str:
    return "prompt" if len(prompts) == 1 else f"prompt[{i}]"


def completion_prompt(rt: Runtime, value: Any, where: str = "prompt") -> list[int]:
    """One prompt: text, token ids, llama-server's mix of both (text pieces are tokenized in place),
    or `{"prompt_string": text or mix}` (with `multimodal_data`: refused, no model here reads media).

    Routes check its size first (`check_prompts`) and run this in a worker thread: tokenizing takes
    time in proportion to the text. (The native tokenizer still holds the GIL, so for now the
    loop waits all the same; the bound is what keeps that short.)"""
    n_vocab = rt.require().model.n_vocab
    if isinstance(value, dict):
        if value.get("multimodal_data") is not None:
            raise BadRequest(
                f"'{where}.multimodal_data': this engine serves a text-only model; multimodal prompts "
                "are not supported",
                param=f"{where}.multimodal_data",
            )
        if "prompt_string" not in value:
            raise BadRequest(
                f"'{where}' must be a string, token ids or an object with 'prompt_string'; "
                "this object has none",
                param=where,
            )
        value, where = value["prompt_string"], f"{where}.prompt_string"
    if isinstance(value, str):
        tokens = rt.tokenize(value, True)
    elif isinstance(value, list) and all(isinstance(v, str) or _is_id(v) for v in value):
        tokens = []
        for i, v in enumerate(value):
            tokens += (
                rt.tokenize(v, i == 0) if isinstance(v, str) else check_tokens([v], n_vocab, f"{where}[{i}]")
            )
    else:
        raise BadRequest(
            f"'{where}' must be a string, an array of token ids, a mix of both, or an object with "
            f"'prompt_string'; got {json_type(value)}",
            param=where,
        )
    if not tokens:
        raise BadRequest(f"'{where}' is empty", param=where)
    return tokens


def check_prompt(value: Any, lim: RequestLimits, n_ctx: int, where: str = "prompt") -> None:
    """Bound one prompt before anything tokenizes it: its text against --max-text-chars, its token
    ids against a slot's context (every id is one token)."""
    check_text(where, value, lim.max_text_chars)
    if isinstance(value, dict):
        value = value.get("prompt_string")
    if isinstance(value, list):
        n_ids = sum(1 for v in value if _is_id(v))
        if n_ids >= n_ctx:
            raise ContextSizeExceeded(n_ids, n_ctx)


def response_fields(body: Body, lim: RequestLimits) -> list[str]:
    """llama-server's `response_fields`: the paths (`a/b` reaches into objects) a /completion
    result is cut down to."""
    fields = body.get_str_list("response_fields")
    check_count("response_fields", fields, lim.max_response_fields, "paths")
    return list(fields)


def select_fields(result: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """`result` cut down to `paths`, each kept under its own name (`generation_settings/n_predict`
    becomes a top-level key of that name); a path that leads nowhere is left out, as llama-server does."""
    out: dict[str, Any] = {}
    for path in paths:
        value: Any = result
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


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
        _completion_final(rt, o, sampling, pieces, fields, texts[runs[i]], streamed=False, index=i)
        for i, o in enumerate(outcomes)
    ]
    return JSONResponse(results[0] if len(results) == 1 else results)


def prompt_text(engine: native.Engine, tokens: list[int]) -> str:
    """llama-server's `prompt` of a result: the prompt's tokens as text, special tokens spelled out.
    Client-sized: call it in a worker thread."""
    return engine.detokenize(tokens, False, True)


def verbose_result(
    rt: Runtime, o: Outcome, sampling: Sampling, prompt: str, pieces: TokenBytes
) -> dict[str, Any]:
    """llama-server's `__verbose` (a response's debug field with `verbose` or `-v`): the generation
    as /completion reports it, the prompt's text included."""
    return _completion_final(rt, o, sampling, pieces, [], prompt, streamed=False)


def token_pieces(engine: native.Engine) -> TokenBytes:
    """A token's piece (special tokens spelled out), remembered for one request's probabilities."""
    seen: dict[int, bytes] = {}

    def piece(token: int) -> bytes:
        if token not in seen:
            seen[token] = engine.token_piece(token, True)
        return seen[token]

    return piece


async def _completion_chunks(
    rt: Runtime,
    gen: AsyncGenerator[Delta | Outcome, None],
    sampling: Sampling,
    pieces: TokenBytes,
    fields: list[str],
    prompt: str,
) -> AsyncGenerator[dict[str, Any], None]:
    async with aclosing(gen) as items:
        async for item in items:
            if isinstance(item, Delta):
                chunk: dict[str, Any] = {
                    "index": 0,
                    "content": item.text,
                    "tokens": item.tokens,
                    "stop": False,
                }
                if item.probs:
                    chunk["completion_probabilities"] = probs_json(item.probs, pieces)
                yield chunk
            else:
                yield _completion_final(rt, item, sampling, pieces, fields, prompt, streamed=True)


def _completion_final(
    rt: Runtime,
    o: Outcome,
    sampling: Sampling,
    pieces: TokenBytes,
    fields: list[str],
    prompt: str,
    *,
    streamed: bool,
    index: int = 0,
) -> dict[str, Any]:
    """The whole result, or (streamed) the last chunk: everything but the text, tokens and
    probabilities already sent; cut down to `fields` when the request named some."""
    result: dict[str, Any] = {
        "index": index,
        "content": "" if streamed else o.text,
        "tokens": [] if streamed else o.tokens,
        "id_slot": o.slot,
        "stop": True,
        "model": rt.settings.model_id,
        "tokens_predicted": o.n_predicted,
        "tokens_evaluated": o.n_prompt,
        "generation_settings": generation_settings(sampling),
        "prompt": prompt,
        "has_new_line": "\n" in o.text,
        "truncated": False,
        "stop_type": o.stop_type,
        "stopping_word": o.stopping_word,
        "tokens_cached": o.n_prompt + max(o.n_predicted - 1, 0),
        "timings": o.timings,
        "slotkeeper": o.reuse,
    }
    if o.probs and not streamed:
        result["completion_probabilities"] = probs_json(o.probs, pieces)
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

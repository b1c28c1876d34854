"""OpenAI-compatible endpoints: /v1/chat/completions (+ /input_tokens), /v1/completions, /v1/models.

Responses follow the OpenAI API as the official SDK parses it, plus llama-server's extras: `timings`
(numbers only) on responses and on the last stream chunk, `id_slot` (which slot served the request),
and `usage.prompt_tokens_details.cached_tokens` = the prompt tokens actually reused (timings.cache_n,
restored ones included). Beside `timings`, `slotkeeper` says how the prefix was served (reuse kind,
restored). `n` choices run as separate decode runs at once, each on a slot of its own (or queued
for one), like a batch of prompts; their prompt counts once in `usage`. `logprobs` come from the
raw logits, streamed with the chunks their tokens made.
"""

from __future__ import annotations

import asyncio
import math
import re
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import asdict, dataclass, replace
from typing import Any

import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import native

from ..common.body import Body, read_json
from ..common.errors import BadRequest
from ..protocol.report import caller_context, served
from ..protocol.sse import start_stream
from .chat_request import (
    ChatRequest,
    Constraint,
    build_constraint,
    continued_open,
    message_text,
    parse_chat,
    prefill_text,
)
from .chat_template import ChatPrompt
from .decoding import (
    Delta,
    Outcome,
    TokenBytes,
    TokenProb,
    collect_all,
    completion_logprobs,
    decode_on_slot,
    probs_json,
    with_biases,
)
from .divergence import in_last_turn, last_reply, left_at, locate
from .formats import (
    ChatFormat,
    ChatOutput,
    Piece,
    Reasoning,
    assemble,
    opened_by,
    select_format,
)
from .formats.reasoning import THINK_CLOSE, THINK_OPEN
from .formats.upstream import UpstreamOutput, UpstreamPlan
from .gbnf import check_grammar
from .grammar import GrammarTriggers
from .routes_llama import (
    aliased,
    check_prompts,
    completion_prompt,
    limits,
    limits_and_body,
    prompt_field,
    prompt_text,
    runtime,
    token_pieces,
    verbose_result,
)
from .runtime import Runtime
from .sampling import read_sampling
from .slot_leases import common_prefix

log = structlog.get_logger("engine.chat")

Output = ChatOutput | UpstreamOutput  # a generation's text read as reasoning, content and calls


@dataclass(frozen=True)
class Meta:
    """What every response and chunk of one request repeats."""

    id: str
    object: str
    created: int
    model: str

    def head(self) -> dict[str, Any]:
        return {**asdict(self), "system_fingerprint": f"slotkeeper-{native.ENGINE_VERSION}"}


def usage(outcomes: list[Outcome], n: int = 1) -> dict[str, Any]:
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


def extras(o: Outcome) -> dict[str, Any]:
    """llama-server's fields beyond OpenAI's (and ours beside them) for one decode run."""
    return {"timings": o.timings, "slotkeeper": o.reuse, "id_slot": o.slot}


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


def chat_prompt(rt: Runtime, req: ChatRequest) -> tuple[ChatPrompt, bool]:
    """The rendered, tokenized conversation (with its checkpoint hints) and whether it leaves a
    reasoning block open. A continued last message (prefill) follows the generation prompt of the
    conversation before it; without the generation prompt, the conversation ends as rendered.
    Renders and tokenizes client-sized text: call it in a worker thread."""

    def tokenize(text: str, add_special: bool) -> list[int]:
        return rt.tokenize(text, add_special)

    history, tools = req.messages, req.tools or None
    if req.continue_final:
        head = rt.template.prompt(tokenize, history[:-1], tools, req.template_kwargs)
        prefill = prefill_text(req.messages[-1])
        text = head.text + prefill
        tokens = rt.template.tokenize(tokenize, text)
        kept = common_prefix(head.tokens, tokens)  # the prefill may merge with the head's last token
        return ChatPrompt(text, tokens, [h for h in head.hints if h <= kept]), continued_open(
            head.text, prefill
        )
    if not req.add_generation_prompt:
        text = rt.template.render(history, tools, add_generation_prompt=False, kwargs=req.template_kwargs)
        return ChatPrompt(text, rt.template.tokenize(tokenize, text), []), opened_by(text)
    prompt = rt.template.prompt(tokenize, history, tools, req.template_kwargs)
    return prompt, opened_by(prompt.text)


async def run_chat(
    request: Request, body: Body, *, empty_ok: bool = False
) -> dict[str, Any] | AsyncGenerator[dict[str, Any], None]:
    """One chat completion from a parsed body: the response object, or (`stream`) its chunks.

    The Responses and Messages routes call this with a body translated from their own shapes and
    translate what comes back, so every API shares one chat path (templates, formats, grammars).
    Beyond OpenAI's shape: `message.reasoning_content` / `delta.reasoning_content` (when the model
    reasoned), and the final choice's `stopping_word` when a stop string ended the generation.
    `empty_ok`: an empty `messages` array is accepted (the Messages API's rule).
    """
    rt = runtime(request)
    engine = rt.require()
    lim = limits(request)
    req = parse_chat(
        body, rt.defaults, lim, n_vocab=engine.model.n_vocab, n_ctx=engine.n_ctx_slot, empty_ok=empty_ok
    )
    fmt = select_format(rt.settings.chat_format, rt.template.source)
    # Preparing the history (JSON arguments), rendering (jinja over client-sized messages, once per
    # checkpoint hint) and tokenizing: off the event loop, like the grammar below.
    prompt, opened = await asyncio.to_thread(chat_prompt, rt, req)  # opened: Qwen3.5, Nemotron-3
    plan = await _upstream_plan(rt, req)
    if plan is not None and req.input_grammars and req.tool_choice != "none":
        raise _no_input_grammars(req, plan)
    tool_grammar = await asyncio.to_thread(_upstream_constraint, rt, req, plan) if plan is not None else None
    triggers: GrammarTriggers | None = None
    if tool_grammar is not None:
        con, triggers = tool_grammar
    else:
        con = await build_constraint(req, lim.schema, fmt, reasoning=opened)
        if plan is not None:  # llama.cpp's layer reads the calls; ours would ban its call tag
            con = replace(con, parse_tools=_parses_calls(req), ban_tool_calls=False)
        if req.input_grammars and con.grammar:
            # A client's grammar inside: nested no deeper than a raw `grammar` may be.
            check_grammar(con.grammar, lim.schema.max_bytes, lim.max_grammar_depth, _input_field(req))
        if con.lazy:
            triggers = _call_tag_triggers(rt, fmt)
    sampling = await with_biases(rt, req.sampling)  # once for every choice
    stops = (*rt.template.stops, *(plan.stops if plan is not None else ()))
    if stops:  # the built-in format's end of turn, should the model write it as text; llama.cpp's
        sampling = replace(sampling, stop=tuple(dict.fromkeys((*sampling.stop, *stops))))
    preserved = _preserved(rt, fmt, plan)
    extra_bias = _tool_call_ban(rt, fmt) if con.ban_tool_calls and plan is None else None

    def gen() -> AsyncGenerator[Delta | Outcome, None]:
        return decode_on_slot(
            rt,
            prompt.tokens,
            sampling,
            grammar=con.grammar,
            triggers=triggers,
            checkpoint_hints=prompt.hints,
            extra_bias=extra_bias,
            endpoint="/v1/chat/completions",
            preserved=preserved,
        )

    def output() -> Output:
        if plan is not None:
            return UpstreamOutput(plan, rt.settings.reasoning_format, con.parse_tools)
        return ChatOutput(
            fmt.stream(req.tools) if con.parse_tools else None, rt.settings.reasoning_format, opened
        )

    meta = Meta(
        f"chatcmpl-{secrets.token_hex(12)}", "chat.completion", int(time.time()), rt.settings.model_id
    )
    pieces = token_pieces(engine)
    context = caller_context(body)

    async def explain(o: Outcome) -> None:
        o.reuse.update(context)
        o.reuse["served"] = served(o.reuse, o.cache_n)
        await diagnose(rt, req, prompt, o)

    debug = None
    if body.get_bool("verbose", False) or rt.settings.verbose:  # llama-server's `__verbose`

        async def debug(o: Outcome) -> dict[str, Any]:
            text = await asyncio.to_thread(prompt_text, engine, prompt.tokens)
            return verbose_result(rt, o, sampling, text, pieces)

    if req.stream:
        return _chat_chunks(gen(), req, output(), meta, pieces, explain, debug, len(prompt.tokens))
    outs = [output() for _ in range(req.n)]
    parts: list[list[Piece]] = [[] for _ in range(req.n)]

    async def read(
        items: AsyncGenerator[Delta | Outcome, None], out: Output, into: list[Piece]
    ) -> AsyncGenerator[Delta | Outcome, None]:
        # The same pieces a stream would send, from the same deltas: the two cannot disagree.
        async with aclosing(items):
            async for item in items:
                if isinstance(item, Delta):
                    into.extend(out.feed(item.text, len(item.tokens)))
                yield item

    outcomes = await collect_all([read(gen(), outs[i], parts[i]) for i in range(req.n)], request)
    await explain(outcomes[0])
    choices = [
        _chat_choice(i, o, parts[i] + outs[i].finish(), req, pieces, several=req.n > 1)
        for i, o in enumerate(outcomes)
    ]
    u = usage(outcomes, req.n)
    u["completion_tokens_details"]["reasoning_tokens"] = sum(out.reasoning_tokens for out in outs)
    response: dict[str, Any] = {**meta.head(), "choices": choices, "usage": u}
    if req.n == 1:
        response.update(extras(outcomes[0]))
    if debug is not None:
        response["__verbose"] = await debug(outcomes[0])
    return response


async def diagnose(rt: Runtime, req: ChatRequest, prompt: ChatPrompt, o: Outcome) -> None:
    """Where the prompt left the state it was compared with, named in the conversation
    (`slotkeeper.diverged`; engine_pool.server.divergence): rendered off the event loop, and only
    for a miss before the last reply."""
    at = left_at(o.reuse, len(prompt.tokens))
    if at is None:
        return
    if in_last_turn(o.reuse, at, rt.leases.turn_slack) or req.continue_final or not req.add_generation_prompt:
        o.reuse["diverged"] = last_reply(req.messages, at)
        return
    history, tools = req.messages, req.tools or None

    def render(messages: Any, with_tools: Any) -> list[int]:
        try:
            text = rt.template.render(
                messages, with_tools, add_generation_prompt=False, kwargs=req.template_kwargs
            )
        except BadRequest:  # a prefix the template refuses alone (Qwen3.5: no user message yet)
            text = rt.template.followed_head(messages, with_tools, req.template_kwargs)
        return rt.template.tokenize(lambda t, special: rt.tokenize(t, special), text) if text else []

    def located() -> dict[str, Any]:
        return locate(render, history, tools, prompt.tokens, at, system_spans(rt, prompt, req.messages))

    o.reuse["diverged"] = await asyncio.to_thread(located)


def system_spans(rt: Runtime, prompt: ChatPrompt, messages: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """Where the leading system messages' text lies in the prompt, in tokens (those found in its
    text). Tokenizes the prompt's text up to each: call it in a worker thread."""
    spans, start = [], 0
    for m in messages:
        if m.get("role") not in ("system", "developer"):
            break
        text = message_text(m).strip()  # (templates trim it)
        at = prompt.text.find(text, start) if text else -1
        if at < 0:
            continue
        start = at + len(text)
        edges = [rt.template.tokenize(lambda t, s: rt.tokenize(t, s), prompt.text[:i]) for i in (at, start)]
        spans.append((common_prefix(edges[0], prompt.tokens), common_prefix(edges[1], prompt.tokens)))
    return spans


def _chat_choice(
    index: int, o: Outcome, pieces: list[Piece], req: ChatRequest, token_bytes: TokenBytes, *, several: bool
) -> dict[str, Any]:
    msg = assemble(pieces)
    message: dict[str, Any] = {"role": "assistant", "content": msg.content}
    if msg.reasoning:
        message["reasoning_content"] = msg.reasoning
    if msg.calls:
        message["tool_calls"] = [c.as_openai() for c in msg.calls]
    choice: dict[str, Any] = {
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


def _chat_logprobs(
    probs: list[TokenProb], req: ChatRequest, token_bytes: TokenBytes
) -> dict[str, Any] | None:
    if req.top_logprobs is None:
        return None
    return {"content": probs_json(probs, token_bytes, req.top_logprobs), "refusal": None}


def _chat_usage(o: Outcome, out: Output) -> dict[str, Any]:
    u = usage([o])
    u["completion_tokens_details"]["reasoning_tokens"] = out.reasoning_tokens
    return u


def _preserved(rt: Runtime, fmt: ChatFormat, plan: UpstreamPlan | None) -> frozenset[int]:
    """The format's tags that are single special tokens (llama.cpp's preserved tokens, under its
    chat layer): their text must reach the output parsers."""
    tags = plan.preserved if plan is not None else (fmt.open, fmt.close)
    ids = (rt.tokenize(tag, False) for tag in (*tags, THINK_OPEN, THINK_CLOSE))
    return frozenset(t[0] for t in ids if len(t) == 1)


async def _upstream_plan(rt: Runtime, req: ChatRequest) -> UpstreamPlan | None:
    """llama.cpp's chat layer's reading of the request, when it reads this template's format (off
    the event loop: it renders the conversation). A named tool_choice is `required` over that tool
    alone, as llama-server does. A conversation the layer refuses while our renderer took it is
    served with the engine's own format, unless the request forces a call."""
    if rt.upstream is None:
        return None
    tools, choice = req.tools, req.tool_choice
    if choice == "function":
        tools, choice = [t for t in tools if t["function"]["name"] == req.tool_name], "required"
    thinking = req.template_kwargs.get("enable_thinking", rt.template.reasoning != "off") is not False
    try:
        return await asyncio.to_thread(
            rt.upstream.plan,
            req.messages,
            tools,
            choice,
            enable_thinking=thinking,
            reasoning_format=rt.settings.reasoning_format,
            kwargs=req.template_kwargs,
        )
    except native.InvalidRequestError as exc:
        if choice == "required":
            raise BadRequest(str(exc)) from None
        log.warning("engine.chat_layer_refused", error=str(exc))
        return None


def _parses_calls(req: ChatRequest) -> bool:
    """Under llama.cpp's layer calls are read whenever tools are offered and not refused."""
    return bool(req.tools) and req.tool_choice != "none"


def _upstream_constraint(
    rt: Runtime, req: ChatRequest, plan: UpstreamPlan
) -> tuple[Constraint, GrammarTriggers] | None:
    """The tool-call grammar of llama.cpp's plan and how it starts (tokenizes: call it off the
    event loop); None when the plan has none for this request, or the client constrains a free
    choice itself (response_format or a raw grammar, as under our formats)."""
    if not (_parses_calls(req) and plan.grammar):
        return None
    if req.tool_choice == "auto" and (req.grammar or req.response_format != "text"):
        return None
    triggers = plan.grammar_triggers(lambda text: rt.tokenize(text, False), rt.token_text)
    return Constraint(plan.grammar, True, False), triggers


def _input_field(req: ChatRequest) -> str:
    """The field of the first tool whose input a grammar constrains, `tools[i].input_grammar`."""
    name = next(iter(req.input_grammars))
    i = next(i for i, t in enumerate(req.tools) if t["function"]["name"] == name)
    return f"tools[{i}].input_grammar"


def _no_input_grammars(req: ChatRequest, plan: UpstreamPlan) -> BadRequest:
    """A tool input grammar under llama.cpp's chat layer: its call format is not one of ours, whose
    grammars write a custom tool's input (formats/), so it could not be enforced: refused."""
    where = _input_field(req)
    return BadRequest(
        f"'{where}': the tool {next(iter(req.input_grammars))!r} constrains its input with a grammar, which "
        f"this model's tool-call format ({plan.format}, read by llama.cpp's chat layer) cannot enforce",
        param=where,
    )


def _call_tag_triggers(rt: Runtime, fmt: ChatFormat) -> GrammarTriggers:
    """Where a `lazy` grammar starts: at the format's call tag — the tag's token when it is one
    token of the vocabulary, and the tag spelled out in several (a pattern searched for: an anchored
    `[\\s\\S]*` one would run libstdc++'s recursive matcher over the whole output, deep as it is long)."""
    ids = rt.tokenize(fmt.open, False)
    tokens = (ids[0],) if len(ids) == 1 else ()
    return GrammarTriggers(lazy=True, patterns=(re.escape(fmt.open),), tokens=tokens)


def _tool_call_ban(rt: Runtime, fmt: ChatFormat) -> dict[int, float]:
    """tool_choice none: forbid the token that opens the family's call block, when it is one token
    of the vocabulary (a tag spelled in several tokens cannot be banned by a bias)."""
    ids = rt.tokenize(fmt.open, False)
    return {ids[0]: -math.inf} if len(ids) == 1 else {}


async def _chat_chunks(
    gen: AsyncGenerator[Delta | Outcome, None],
    req: ChatRequest,
    out: Output,
    meta: Meta,
    token_bytes: TokenBytes,
    explain: Callable[[Outcome], Awaitable[None]],
    debug: Callable[[Outcome], Awaitable[dict[str, Any]]] | None,
    n_prompt: int,
) -> AsyncGenerator[dict[str, Any], None]:
    """The chunks of one streamed chat. The first (the assistant's role) also carries
    `slotkeeper.prompt_tokens`, the prompt's size once its evaluation is done, which the Messages
    stream reports in its `message_start`; the finishing one `__verbose` when asked for."""
    head = {**meta.head(), "object": "chat.completion.chunk"}
    n_calls = 0
    pending: list[TokenProb] = []  # probabilities of tokens whose text no chunk has carried yet

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

    def with_probs(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # A chunk carries the probabilities of the tokens that made it (and of held-back ones before).
        if chunks and pending:
            chunks[-1]["choices"][0]["logprobs"] = _chat_logprobs(pending, req, token_bytes)
            pending.clear()
        return chunks

    started = False
    async with aclosing(gen) as items:
        async for item in items:
            if not started:
                started = True
                first = chunk({"role": "assistant", "content": None})  # as OpenAI and llama-server
                first["slotkeeper"] = {"prompt_tokens": n_prompt}
                yield first
            if isinstance(item, Delta):
                pending.extend(item.probs)
                for c in with_probs(pieces(out.feed(item.text, len(item.tokens)))):
                    yield c
                continue
            for c in with_probs(pieces(out.finish())):
                yield c
            await explain(item)
            last = with_probs([chunk({}, "tool_calls" if n_calls else item.finish_reason)])[0]
            if item.stop_type == "word":
                last["choices"][0]["stopping_word"] = item.stopping_word
            last.update(extras(item))
            if debug is not None:
                last["__verbose"] = await debug(item)
            yield last
            if req.include_usage:
                yield {**head, "choices": [], "usage": _chat_usage(item, out), **extras(item)}


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
        return await start_stream(_completion_chunks(gen, meta, include_usage, top, pieces), done_marker=True)
    runs = [p for p in tokens for _ in range(n)]  # OpenAI's order: the choices of each prompt together
    outcomes = await collect_all(
        [decode_on_slot(rt, p, sampling, endpoint="/v1/completions") for p in runs], request
    )
    response: dict[str, Any] = {
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


async def _completion_chunks(
    gen: AsyncGenerator[Delta | Outcome, None],
    meta: Meta,
    include_usage: bool,
    top: int | None,
    token_bytes: TokenBytes,
) -> AsyncGenerator[dict[str, Any], None]:
    head = meta.head()
    offset = 0  # characters of the completion so far: where the next chunk's tokens start

    def chunk(text: str, finish: str | None, probs: tuple[TokenProb, ...] = ()) -> dict[str, Any]:
        nonlocal offset
        logprobs = None
        if top is not None and probs:
            logprobs = completion_logprobs(probs, token_bytes, top, offset)
        offset += len(text)
        out = {**head, "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            out["usage"] = None
        return out

    async with aclosing(gen) as items:
        async for item in items:
            if isinstance(item, Delta):
                if item.text or item.probs:
                    yield chunk(item.text, None, item.probs)
                continue
            last = chunk("", item.finish_reason)
            last.update(extras(item))
            yield last
            if include_usage:
                yield {**head, "choices": [], "usage": usage([item]), **extras(item)}


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

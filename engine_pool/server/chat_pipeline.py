"""How the engine runs a chat: the one chat path every API shares.

`run_chat` takes a chat completions body (OpenAI's, or one the Responses, Messages and Vertex routes
translated from theirs) and returns the `chat.completion` object or, streamed, its chunks
(`openai_answer`). In order: parse and bound the request (`chat_request`), render and tokenize the
conversation with its checkpoint hints (`chat_prompt`, in a worker thread), let llama.cpp's chat
layer read the request when it knows the template's format (`_upstream_plan`), build the grammar
that constrains the output (tool calls, response_format, a raw grammar), run one decode run per
choice (`decoding`), read each generation as reasoning, content and tool calls (`formats/`), and
say what was reused and, on a miss, where the prompt diverged (`diagnose`).
"""

from __future__ import annotations

import asyncio
import math
import re
import secrets
import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace

import structlog
from starlette.requests import Request

import native
from engine_pool.errors import BadRequest
from engine_pool.http.body import Body

from ..protocol.chat_types import ChatMessage, ChatTool
from ..protocol.engine_answers import ChatChunk, ChatCompletion, LlamaCompletion
from ..protocol.report import Divergence, caller_context, served
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
from .completion_result import prompt_text, verbose_result
from .decoding import Decoded, Delta, Outcome, collect_all, decode_on_slot, token_pieces, with_biases
from .divergence import in_last_turn, last_reply, left_at, locate
from .formats import ChatFormat, ChatOutput, Piece, opened_by, select_format
from .formats.reasoning import THINK_CLOSE, THINK_OPEN
from .formats.upstream import UpstreamOutput, UpstreamPlan
from .gbnf import check_grammar
from .grammar import GrammarTriggers
from .limits import RequestLimits
from .openai_answer import Meta, Output, chat_choice, chat_chunks, extras, usage
from .route_context import limits, runtime
from .runtime import Runtime
from .sampling import Sampling
from .slot_leases import common_prefix

log = structlog.get_logger("engine.chat")


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
) -> ChatCompletion | AsyncGenerator[ChatChunk, None]:
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
    prompt = held_back(prompt, body.get_int("prefill_hold_back", 0, lo=0, hi=1), req.sampling.n_predict)
    how = await decoding_plan(rt, req, lim, fmt, opened)

    def gen() -> AsyncGenerator[Decoded, None]:
        return decode_on_slot(
            rt,
            prompt.tokens,
            how.sampling,
            grammar=how.constraint.grammar,
            triggers=how.triggers,
            checkpoint_hints=prompt.hints,
            extra_bias=how.extra_bias,
            endpoint="/v1/chat/completions",
            preserved=how.preserved,
        )

    def output() -> Output:
        if how.upstream is not None:
            return UpstreamOutput(how.upstream, rt.settings.reasoning_format, how.constraint.parse_tools)
        parser = fmt.stream(req.tools) if how.constraint.parse_tools else None
        return ChatOutput(parser, rt.settings.reasoning_format, opened)

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

        async def debug(o: Outcome) -> LlamaCompletion:
            text = await asyncio.to_thread(prompt_text, engine, prompt.tokens)
            return verbose_result(rt, o, how.sampling, text, pieces)

    if req.stream:
        return chat_chunks(gen(), req, output(), meta, pieces, explain, debug, len(prompt.tokens))
    outs = [output() for _ in range(req.n)]
    parts: list[list[Piece]] = [[] for _ in range(req.n)]
    outcomes = await collect_all([_read(gen(), outs[i], parts[i]) for i in range(req.n)], request)
    await explain(outcomes[0])
    choices = [
        chat_choice(i, o, parts[i] + outs[i].finish(), req, pieces, several=req.n > 1)
        for i, o in enumerate(outcomes)
    ]
    u = usage(outcomes, req.n)
    u["completion_tokens_details"]["reasoning_tokens"] = sum(out.reasoning_tokens for out in outs)
    response: ChatCompletion = {**meta.head(), "choices": choices, "usage": u}
    if req.n == 1:
        response.update(extras(outcomes[0]))
    if debug is not None:
        response["__verbose"] = await debug(outcomes[0])
    return response


async def _read(
    items: AsyncGenerator[Decoded, None], out: Output, into: list[Piece]
) -> AsyncGenerator[Decoded, None]:
    """`items` passed on, their text fed to ``out`` and its pieces kept in ``into``: the same pieces
    a stream would send, from the same deltas, so the two cannot disagree."""
    async with aclosing(items):
        async for item in items:
            if isinstance(item, Delta):
                into.extend(out.feed(item.text, len(item.tokens)))
            yield item


@dataclass(frozen=True)
class DecodingPlan:
    """How one chat request is decoded, the same for each of its choices: the constraint (grammar,
    whether tool calls are parsed or banned) and its lazy triggers, the sampling with the template's
    stop strings, the tokens a constraint never bans (`preserved`), a bias against a call tag no
    call may start (`extra_bias`), and llama.cpp's chat layer's plan where it reads the template."""

    constraint: Constraint
    triggers: GrammarTriggers | None
    sampling: Sampling
    preserved: frozenset[int]
    extra_bias: dict[int, float] | None
    upstream: UpstreamPlan | None


async def decoding_plan(
    rt: Runtime, req: ChatRequest, lim: RequestLimits, fmt: ChatFormat, opened: bool
) -> DecodingPlan:
    """The request's `DecodingPlan`; grammars are built off the event loop. ``opened``: the prompt
    opened a reasoning block the answer goes on with (Qwen3.5, Nemotron-3)."""
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
    extra_bias = _tool_call_ban(rt, fmt) if con.ban_tool_calls and plan is None else None
    return DecodingPlan(con, triggers, sampling, _preserved(rt, fmt, plan), extra_bias, plan)


def held_back(prompt: ChatPrompt, hold: int, n_predict: int) -> ChatPrompt:
    """The prompt less its last ``hold`` tokens, for a prefill that generates nothing (``n_predict``
    0): the `last-token` handoff (engine_pool.protocol.handoff), whose decode side evaluates them.
    Any other request is left as it is: its answer would continue a prompt it never saw."""
    if not hold or n_predict != 0 or len(prompt.tokens) <= hold:
        return prompt
    n = len(prompt.tokens) - hold
    return ChatPrompt(prompt.text, prompt.tokens[:n], [h for h in prompt.hints if h <= n])


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

    def render(messages: Sequence[ChatMessage], with_tools: Sequence[ChatTool] | None) -> list[int]:
        try:
            text = rt.template.render(
                messages, with_tools, add_generation_prompt=False, kwargs=req.template_kwargs
            )
        except BadRequest:  # a prefix the template refuses alone (Qwen3.5: no user message yet)
            text = rt.template.followed_head(messages, with_tools, req.template_kwargs)
        return rt.template.tokenize(lambda t, special: rt.tokenize(t, special), text) if text else []

    def located() -> Divergence:
        return locate(render, history, tools, prompt.tokens, at, system_spans(rt, prompt, req.messages))

    o.reuse["diverged"] = await asyncio.to_thread(located)


def system_spans(rt: Runtime, prompt: ChatPrompt, messages: list[ChatMessage]) -> list[tuple[int, int]]:
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

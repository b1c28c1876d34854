"""An OpenAI chat request, validated: messages, tools, tool_choice, response_format, stream options.

`parse_chat` checks the shape — and the size, against `RequestLimits` — of everything the engine
acts on and says precisely what is wrong; `constraint` decides (purely) which grammar the output
must follow and whether tool calls are parsed from it: forced calls are written in the model
family's format (`formats.ChatFormat`), and when the prompt leaves a reasoning block open every
grammar built here lets the model finish it first. Building that grammar from a large schema takes
time: routes call `build_constraint`, which runs it in a worker thread.

llama-server's extensions read here: a top-level `json_schema` (like `response_format`'s schema),
`n` choices, `logprobs`/`top_logprobs` (or `n_probs`), and assistant prefill: a conversation that
ends with an assistant message continues that message (`continue_final_message`, implied when the
last message is the assistant's, exactly as llama-server does) instead of opening a new turn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

from engine_pool.errors import BadRequest
from engine_pool.http.body import Body, json_type

from ..protocol.bounds import array_form, check_count
from ..protocol.chat_types import ChatMessage, ChatTool
from ..protocol.tool_grammar import SYNTAXES, TextGrammar, parse_grammar
from ..protocol.tools import tool_choice_mode
from .formats import FORMATS, ChatFormat
from .formats.qwen_xml import is_string
from .formats.reasoning import THINK_OPEN, opened_by
from .gbnf import check_grammar
from .grammar import (
    INPUT_GRAMMAR,
    THINK_CLOSE,
    GrammarLimits,
    built_off_loop,
    input_grammar,
    json_object_grammar,
    schema_grammar,
)
from .limits import RequestLimits, check_text
from .sampling import Sampling, read_sampling

_TEXT_PART = "text"
# A function tool's `input_grammar` (a Slotkeeper extension, how the Responses API's custom tools
# reach the chat path): its one parameter `input` is free text, a sentence of this grammar.
INPUT_GRAMMAR_FIELD = "input_grammar"


@dataclass(frozen=True)
class ChatRequest:
    messages: list[ChatMessage]
    tools: list[ChatTool]  # without `input_grammar` (in `input_grammars`)
    tool_choice: str  # none | auto | required | function
    tool_name: str | None  # the function forced by tool_choice {"type": "function", ...}
    response_format: str  # text | json_object | json_schema
    schema: Any
    grammar: str  # llama-server's raw `grammar` field
    stream: bool
    include_usage: bool
    template_kwargs: Mapping[str, object]  # the client's `chat_template_kwargs`, for the template
    sampling: Sampling
    n: int = 1  # choices, each its own generation of the same prompt
    top_logprobs: int | None = None  # None: no logprobs; else alternatives per token
    continue_final: bool = False  # continue the last (assistant) message instead of a new turn
    add_generation_prompt: bool = True
    schema_field: str = "response_format.json_schema.schema"  # where `schema` came from
    # The tools whose `input` parameter a grammar constrains (`input_grammar`), by name.
    input_grammars: dict[str, TextGrammar] = field(default_factory=dict)


@dataclass(frozen=True)
class Constraint:
    grammar: str
    parse_tools: bool
    ban_tool_calls: bool
    lazy: bool = False  # the grammar applies from the chat format's call tag on (chat_pipeline)


def parse_messages(body: Body, limits: RequestLimits, *, empty_ok: bool = False) -> list[ChatMessage]:
    """The client's messages, checked to be `ChatMessage`s (copies, with any other keys they have).
    `empty_ok`: an empty array is a conversation too (the Messages API, as llama-server's: the
    template renders no turn, then the generation prompt)."""
    raw = body.get_list("messages")
    if raw is None or (not raw and not empty_ok):
        raise BadRequest("'messages' must be a non-empty array of messages", param="messages")
    check_count("messages", raw, limits.max_messages, "messages")
    # Everything a template may render counts: content, names, tool call arguments, extras.
    check_text("messages", raw, limits.max_text_chars)
    out: list[ChatMessage] = []
    for message in body.objects("messages"):
        where, m = message.path, message.data
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise BadRequest(f"'{where}.role' must be a non-empty string", param=f"{where}.role")
        content = m.get("content")
        if content is None and role != "assistant":
            raise BadRequest(f"'{where}.content' is required for role {role!r}", param=f"{where}.content")
        if content is not None and not isinstance(content, str):
            _check_parts(content, f"{where}.content", limits.max_messages)
        if m.get("tool_calls") is not None:
            _check_tool_calls(m["tool_calls"], f"{where}.tool_calls", limits.max_tools)
        if not isinstance(m.get("reasoning_content", ""), str | None):
            # Templates write it as text (`|trim`, `+`): anything else would fail inside them.
            raise BadRequest(
                f"'{where}.reasoning_content' must be a string", param=f"{where}.reasoning_content"
            )
        out.append(cast(ChatMessage, dict(m)))  # its role, content and calls checked above
    return out


def _check_parts(content: Any, where: str, max_parts: int) -> None:
    parts = array_form(content, where, max_parts, "content parts")  # no more parts than messages
    for j, part in enumerate(parts):
        if not isinstance(part, dict):
            raise BadRequest(f"'{where}[{j}]' must be an object", param=where)
        if part.get("type") != _TEXT_PART:
            raise BadRequest(
                f"'{where}[{j}]': content part type {part.get('type')!r} is not supported (text only)",
                param=where,
            )
        if not isinstance(part.get("text"), str):
            raise BadRequest(f"'{where}[{j}].text' must be a string", param=where)


def _check_tool_calls(calls: Any, where: str, max_calls: int) -> None:
    if not isinstance(calls, list):
        raise BadRequest(f"'{where}' must be an array", param=where)
    check_count(where, calls, max_calls, "tool calls")  # no more calls than tools
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"'{where}[{j}].function.name' must be a string", param=where)
        if not isinstance(fn.get("arguments", ""), str | dict):
            raise BadRequest(f"'{where}[{j}].function.arguments' must be a JSON string", param=where)


def parse_tools(body: Body, limits: RequestLimits) -> list[ChatTool]:
    """The client's function tools, checked to be `ChatTool`s (copies, without `input_grammar`)."""
    raw = body.get_list("tools") or []
    check_count("tools", raw, limits.max_tools, "tools")
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise BadRequest(f'\'{where}\' must be {{"type": "function", "function": {{...}}}}', param=where)
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(f"'{where}.function.name' must be a non-empty string", param=where)
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise BadRequest(f"'{where}.function.parameters' must be a JSON schema object", param=where)
    # The template renders the tools: an extension of ours must not reach the prompt.
    return [cast(ChatTool, {k: v for k, v in t.items() if k != INPUT_GRAMMAR_FIELD}) for t in raw]


def parse_input_grammars(body: Body) -> dict[str, TextGrammar]:
    """The tools' `input_grammar`s ({"syntax": "lark" | "regex", "definition": ...}), read (and
    bounded) by engine_pool.protocol.tool_grammar, by tool name (`parse_tools` checked the rest)."""
    out = {}
    for i, t in enumerate(body.get_list("tools") or []):
        spec = t.get(INPUT_GRAMMAR_FIELD)
        if spec is None:
            continue
        where = f"tools[{i}].{INPUT_GRAMMAR_FIELD}"
        if not isinstance(spec, dict):
            raise BadRequest(f"'{where}' must be an object {{syntax, definition}}", param=where)
        syntax, definition = spec.get("syntax"), spec.get("definition")
        if syntax not in SYNTAXES:
            raise BadRequest(
                f"'{where}.syntax' must be one of {', '.join(SYNTAXES)}", param=f"{where}.syntax"
            )
        if not isinstance(definition, str):
            raise BadRequest(f"'{where}.definition' must be a string", param=f"{where}.definition")
        out[t["function"]["name"]] = parse_grammar(syntax, definition, f"{where}.definition")
    return out


def parse_chat(
    body: Body,
    defaults: Sampling,
    limits: RequestLimits,
    *,
    n_vocab: int,
    n_ctx: int,
    empty_ok: bool = False,
) -> ChatRequest:
    messages = parse_messages(body, limits, empty_ok=empty_ok)
    tools = parse_tools(body, limits)
    input_grammars = parse_input_grammars(body)
    names = [t["function"]["name"] for t in tools]
    choice, name = _tool_choice(body, names)
    fmt, schema = _response_format(body)
    options = body.get_object("stream_options")
    kwargs = body.get_object("chat_template_kwargs")
    grammar = body.get_str("grammar", "") or ""
    check_grammar(grammar, limits.max_grammar_bytes, limits.max_grammar_depth)
    schema_field = "response_format.json_schema.schema" if fmt == "json_schema" else "response_format.schema"
    if body.has("json_schema"):  # llama-server's own field: a schema without response_format
        if grammar:
            raise BadRequest("Cannot use both json_schema and grammar", param="json_schema")
        if fmt != "text":
            raise BadRequest(
                "'json_schema' and 'response_format' both constrain the output: send one", param="json_schema"
            )
        if not isinstance(body.raw("json_schema"), dict | bool):
            raise BadRequest("'json_schema' must be a JSON schema object", param="json_schema")
        fmt, schema, schema_field = "json_schema", body.raw("json_schema"), "json_schema"
    stream = body.get_bool("stream", False)
    n = body.get_int("n", 1, lo=1, hi=limits.max_generations)
    if n > 1 and stream:
        raise BadRequest(
            "'n' above 1 is not supported with 'stream': ask for one choice per stream", param="n"
        )
    sampling = read_sampling(body, defaults, limits, n_vocab=n_vocab, n_ctx=n_ctx)
    top_logprobs = _logprobs(body, limits.max_n_probs, sampling.n_probs)
    if top_logprobs is not None:
        sampling = replace(sampling, n_probs=max(top_logprobs, 1))  # the core reports none at 0
    continue_final, add_generation_prompt = continuation(
        messages,
        body.get_bool("add_generation_prompt", True),
        body.raw("continue_final_message"),
    )
    return ChatRequest(
        messages=messages,
        tools=tools,
        tool_choice=choice,
        tool_name=name,
        response_format=fmt,
        schema=schema,
        grammar=grammar,
        stream=stream,
        include_usage=options.get_bool("include_usage", False) if options else False,
        template_kwargs=dict(kwargs.data) if kwargs else {},
        sampling=sampling,
        n=n,
        top_logprobs=top_logprobs,
        continue_final=continue_final,
        add_generation_prompt=add_generation_prompt,
        schema_field=schema_field,
        input_grammars=input_grammars,
    )


def _logprobs(body: Body, max_n: int, n_probs: int) -> int | None:
    """Alternatives per token the response reports (None: no `logprobs`). OpenAI's `logprobs: true`
    with `top_logprobs` (0 when absent, as OpenAI; llama-server defaults to 20), or llama-server's
    `n_probs` sent on chat directly."""
    if body.get_bool("logprobs", False):
        return body.get_int("top_logprobs", 0, lo=0, hi=max_n)
    if body.has("top_logprobs"):
        raise BadRequest("top_logprobs requires logprobs to be set to true", param="top_logprobs")
    return n_probs or None


def continuation(
    messages: Sequence[ChatMessage], add_generation_prompt: bool, continue_final: Any
) -> tuple[bool, bool]:
    """(continue the last message, add the generation prompt), by llama-server's rules: a last
    message from the assistant is continued (prefill, whatever `add_generation_prompt` says), and
    then the one before must not be the assistant's; `continue_final_message: true` (or "content") asks
    for it explicitly and needs `add_generation_prompt: false`; a message with tool calls cannot
    be continued. (llama-server also refuses a history that merely ends with a tool call; here such a
    message is a finished turn, rendered as the template renders it, as before prefill existed.)"""
    if continue_final is None or continue_final is False:
        explicit = False
    elif continue_final is True or continue_final == "content":
        explicit = True
    elif continue_final == "reasoning_content":
        raise BadRequest(
            "'continue_final_message': continuing the reasoning ('reasoning_content') is not supported by "
            "this engine; send true to continue the message's content",
            param="continue_final_message",
        )
    else:
        raise BadRequest(
            f"'continue_final_message' must be a boolean or \"content\", got {json_type(continue_final)}",
            param="continue_final_message",
        )
    last: Mapping[str, object] = messages[-1] if messages else {}
    if explicit:
        if add_generation_prompt:
            raise BadRequest(
                "Cannot set both add_generation_prompt and continue_final_message to true.",
                param="continue_final_message",
            )
        if last.get("role") != "assistant":
            raise BadRequest(
                "'continue_final_message' continues the last message, which must be the assistant's",
                param="continue_final_message",
            )
    elif last.get("role") == "assistant" and not last.get("tool_calls"):
        if len(messages) >= 2 and messages[-2].get("role") == "assistant":
            raise BadRequest(
                "Cannot have 2 or more assistant messages at the end of the list.", param="messages"
            )
    else:
        return False, add_generation_prompt
    if last.get("tool_calls"):
        raise BadRequest("Cannot continue an assistant message that contains tool calls.", param="messages")
    return True, False


def message_text(message: ChatMessage) -> str:
    """The text of a message's content: the string, or its text parts joined (the assistant
    message a prefill continues, a system prompt the reuse report looks for)."""
    content = message.get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def prefill_text(message: ChatMessage) -> str:
    """The text a prefill continues: the final assistant message's string, or its text parts joined
    by a blank line, as llama-server joins them (`[Wh, ill]` continues `Wh\\n\\nill`)."""
    content = message.get("content")
    if isinstance(content, list):
        return "\n\n".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return content if isinstance(content, str) else ""


def continued_open(head: str, prefill: str) -> bool:
    """Whether a prompt continuing `prefill` after `head` (rendered up to the generation prompt)
    leaves a reasoning block open: the generation prompt opened one, or the prefill did, and the
    prefill has not closed it."""
    tail = (THINK_OPEN if opened_by(head) else "") + prefill
    start = tail.rfind(THINK_OPEN)
    return start >= 0 and THINK_CLOSE not in tail[start:]


def _tool_choice(body: Body, names: list[str]) -> tuple[str, str | None]:
    raw = body.raw("tool_choice", "auto" if names else "none")
    if isinstance(raw, str):
        return tool_choice_mode(raw, ("none", "auto", "required"), names), None
    fn = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadRequest(
            '\'tool_choice\' must be a string or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if fn["name"] not in names:
        raise BadRequest(
            f"'tool_choice' names function {fn['name']!r}, which is not among 'tools'", param="tool_choice"
        )
    return "function", fn["name"]


def _response_format(body: Body) -> tuple[str, Any]:
    rf = body.get_object("response_format")
    if rf is None:
        return "text", None
    kind = rf.get_choice("type", "text", ("text", "json_object", "json_schema"))
    if kind == "json_schema":
        js = rf.get_object("json_schema")
        if js is None or not isinstance(js.raw("schema"), dict | bool):
            raise BadRequest(
                "'response_format.json_schema.schema' must be a JSON schema object", param="response_format"
            )
        return kind, js.raw("schema")
    if kind == "json_object":
        return kind, rf.raw("schema")  # llama-server accepts a schema here too
    return kind, None


def input_schema(g: TextGrammar) -> dict[str, Any]:
    """The arguments of a tool whose input `g` constrains, as the grammar builders read them."""
    return {
        "type": "object",
        "properties": {"input": {"type": "string", INPUT_GRAMMAR: g}},
        "required": ["input"],
    }


def lenient_schema(params: Any) -> dict[str, Any] | None:
    """What a function's call is held to, inside a grammar that constrains other tools' calls,
    when its own schema has what grammars here do not express: its declared parameters, the
    required ones always, each a string when every value it admits is one, else any JSON value (no
    more than a call under tool_choice auto is held to without such a grammar). None for a tool
    whose input grammar failed: that failure is the request's."""
    props = params.get("properties") if isinstance(params, dict) else None
    if not isinstance(props, dict):
        return {"type": "object", "properties": {}}
    if any(input_grammar(p) is not None for p in props.values()):
        return None
    required = params.get("required")
    return {
        "type": "object",
        "properties": {k: {"type": "string"} if is_string(v, params) else {} for k, v in props.items()},
        "required": [r for r in required if r in props] if isinstance(required, list) else [],
    }


def constraint(
    req: ChatRequest,
    limits: GrammarLimits | None = None,
    fmt: ChatFormat = FORMATS["hermes"],
    *,
    reasoning: bool = False,
) -> Constraint:
    """The grammar for the output and how to read it; a forced tool call wins over response_format.

    `fmt`: the family's tool-call format; `reasoning`: the prompt leaves a reasoning block open (a
    raw `grammar` from the client is taken as it is). A tool whose input has a grammar holds the
    calls to it under tool_choice auto too: from the format's call tag on (`lazy`), every call is
    written in the format, that tool's input a sentence of its grammar.
    """
    tools = {t["function"]["name"]: t["function"].get("parameters") or {} for t in req.tools}
    for name, g in req.input_grammars.items():
        tools[name] = input_schema(g)
    if req.tool_choice == "function" and req.tool_name is not None:
        forced = [(req.tool_name, tools[req.tool_name])]
        return Constraint(fmt.grammar(forced, limits, reasoning=reasoning), True, False)
    if req.tool_choice == "required":
        return Constraint(fmt.grammar(list(tools.items()), limits, reasoning=reasoning), True, False)
    parse = bool(req.tools) and req.tool_choice == "auto"
    ban = bool(req.tools) and req.tool_choice == "none"
    if parse and req.input_grammars:
        if req.response_format != "text" or req.grammar:
            name = next(iter(req.input_grammars))
            raise BadRequest(
                f"'tools[{_tool_index(req, name)}]': the tool {name!r} constrains its input with a grammar, "
                "which cannot be combined with a constrained reply ('response_format', 'grammar' or "
                "'json_schema') under tool_choice auto",
                param=f"tools[{_tool_index(req, name)}]",
            )
        grammar = fmt.grammar(list(tools.items()), limits, repeated=True, lenient=lenient_schema)
        return Constraint(grammar, True, False, lazy=True)
    if req.response_format == "json_schema" or (req.response_format == "json_object" and req.schema):
        grammar = schema_grammar(req.schema, req.schema_field, limits=limits, reasoning=reasoning)
        return Constraint(grammar, parse, ban)
    if req.response_format == "json_object":
        return Constraint(json_object_grammar(reasoning=reasoning), parse, ban)
    return Constraint(req.grammar, parse, ban)


def _tool_index(req: ChatRequest, name: str) -> int:
    return next(i for i, t in enumerate(req.tools) if t["function"]["name"] == name)


def builds_grammar(req: ChatRequest) -> bool:
    """Whether `constraint` converts a schema or tools (work worth a thread), or only passes through."""
    return (
        req.tool_choice in ("function", "required")
        or req.response_format != "text"
        or (bool(req.input_grammars) and req.tool_choice == "auto")
    )


async def build_constraint(
    req: ChatRequest, limits: GrammarLimits, fmt: ChatFormat = FORMATS["hermes"], *, reasoning: bool = False
) -> Constraint:
    """`constraint` off the event loop when it builds a grammar: a large schema takes long enough
    to stall every other request (and /health) of the engine if converted on the loop."""
    if not builds_grammar(req):
        return constraint(req, limits, fmt, reasoning=reasoning)
    source = "tools" if req.tool_choice in ("function", "required", "auto") else req.response_format
    return await built_off_loop(
        source, lambda: constraint(req, limits, fmt, reasoning=reasoning), lambda c: c.grammar
    )

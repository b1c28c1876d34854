"""An OpenAI chat request, validated: messages, tools, tool_choice, response_format, stream options.

`parse_chat` checks the shape — and the size, against `RequestLimits` — of everything the engine
acts on and says precisely what is wrong; `constraint` decides (purely) which grammar the output
must follow and whether tool calls are parsed from it: forced calls are written in the model
family's format (`formats.ChatFormat`), and when the prompt leaves a reasoning block open every
grammar built here lets the model finish it first. Building that grammar from a large schema takes
time: routes call `build_constraint`, which runs it in a worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..body import Body, json_type
from ..errors import BadRequest
from .formats import FORMATS, ChatFormat
from .gbnf import check_grammar
from .grammar import GrammarLimits, built_off_loop, json_object_grammar, schema_grammar
from .limits import RequestLimits, check_count, check_text
from .sampling import Sampling, read_sampling

_TEXT_PART = "text"


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    tool_choice: str  # none | auto | required | function
    tool_name: str | None  # the function forced by tool_choice {"type": "function", ...}
    response_format: str  # text | json_object | json_schema
    schema: Any
    grammar: str  # llama-server's raw `grammar` field
    stream: bool
    include_usage: bool
    template_kwargs: dict[str, Any]
    sampling: Sampling


@dataclass(frozen=True)
class Constraint:
    grammar: str
    parse_tools: bool
    ban_tool_calls: bool


def parse_messages(body: Body, limits: RequestLimits) -> list[dict[str, Any]]:
    raw = body.get_list("messages")
    if not raw:
        raise BadRequest("'messages' must be a non-empty array of messages", param="messages")
    check_count("messages", raw, limits.max_messages, "messages")
    # Everything a template may render counts: content, names, tool call arguments, extras.
    check_text("messages", raw, limits.max_text_chars)
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"'{where}' must be an object, got {json_type(m)}", param=where)
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
        out.append(dict(m))
    return out


def _check_parts(content: Any, where: str, max_parts: int) -> None:
    if not isinstance(content, list):
        raise BadRequest(
            f"'{where}' must be a string or an array of content parts, got {json_type(content)}", param=where
        )
    check_count(where, content, max_parts, "content parts")  # no more parts than messages
    for j, part in enumerate(content):
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


def parse_tools(body: Body, limits: RequestLimits) -> list[dict[str, Any]]:
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
    return list(raw)


def parse_chat(
    body: Body, defaults: Sampling, limits: RequestLimits, *, n_vocab: int, n_ctx: int
) -> ChatRequest:
    messages = parse_messages(body, limits)
    tools = parse_tools(body, limits)
    names = [t["function"]["name"] for t in tools]
    choice, name = _tool_choice(body, names)
    fmt, schema = _response_format(body)
    if body.get_int("n", 1) != 1:
        raise BadRequest("'n' must be 1: this engine returns one choice per request", param="n")
    if body.get_bool("logprobs", False):
        raise BadRequest("'logprobs' is not supported by this engine", param="logprobs")
    options = body.get_object("stream_options")
    kwargs = body.get_object("chat_template_kwargs")
    grammar = body.get_str("grammar", "") or ""
    check_grammar(grammar, limits.max_grammar_bytes, limits.max_grammar_depth)
    return ChatRequest(
        messages=messages,
        tools=tools,
        tool_choice=choice,
        tool_name=name,
        response_format=fmt,
        schema=schema,
        grammar=grammar,
        stream=body.get_bool("stream", False),
        include_usage=options.get_bool("include_usage", False) if options else False,
        template_kwargs=dict(kwargs.data) if kwargs else {},
        sampling=read_sampling(body, defaults, limits, n_vocab=n_vocab, n_ctx=n_ctx),
    )


def _tool_choice(body: Body, names: list[str]) -> tuple[str, str | None]:
    raw = body.raw("tool_choice", "auto" if names else "none")
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise BadRequest(
                f"'tool_choice' must be none, auto, required or a function; got {raw!r}", param="tool_choice"
            )
        if raw == "required" and not names:
            raise BadRequest("'tool_choice' is 'required' but no 'tools' were given", param="tool_choice")
        return raw, None
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


def constraint(
    req: ChatRequest,
    limits: GrammarLimits | None = None,
    fmt: ChatFormat = FORMATS["hermes"],
    *,
    reasoning: bool = False,
) -> Constraint:
    """The grammar for the output and how to read it; a forced tool call wins over response_format.

    `fmt`: the family's tool-call format; `reasoning`: the prompt leaves a reasoning block open (a
    raw `grammar` from the client is taken as it is).
    """
    tools = {t["function"]["name"]: t["function"].get("parameters") or {} for t in req.tools}
    if req.tool_choice == "function" and req.tool_name is not None:
        forced = [(req.tool_name, tools[req.tool_name])]
        return Constraint(fmt.grammar(forced, limits, reasoning=reasoning), True, False)
    if req.tool_choice == "required":
        return Constraint(fmt.grammar(list(tools.items()), limits, reasoning=reasoning), True, False)
    parse = bool(req.tools) and req.tool_choice == "auto"
    ban = bool(req.tools) and req.tool_choice == "none"
    if req.response_format == "json_schema" or (req.response_format == "json_object" and req.schema):
        return Constraint(schema_grammar(req.schema, limits=limits, reasoning=reasoning), parse, ban)
    if req.response_format == "json_object":
        return Constraint(json_object_grammar(reasoning=reasoning), parse, ban)
    return Constraint(req.grammar, parse, ban)


def builds_grammar(req: ChatRequest) -> bool:
    """Whether `constraint` converts a schema or tools (work worth a thread), or only passes through."""
    return req.tool_choice in ("function", "required") or req.response_format != "text"


async def build_constraint(
    req: ChatRequest, limits: GrammarLimits, fmt: ChatFormat = FORMATS["hermes"], *, reasoning: bool = False
) -> Constraint:
    """`constraint` off the event loop when it builds a grammar: a large schema takes long enough
    to stall every other request (and /health) of the engine if converted on the loop."""
    if not builds_grammar(req):
        return constraint(req, limits, fmt, reasoning=reasoning)
    source = "tools" if req.tool_choice in ("function", "required") else req.response_format
    return await built_off_loop(
        source, lambda: constraint(req, limits, fmt, reasoning=reasoning), lambda c: c.grammar
    )

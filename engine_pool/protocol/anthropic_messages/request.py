"""An Anthropic Messages request (`POST /v1/messages`), validated and translated to chat. Pure.

`parse_request` checks every field this server acts on and refuses, with a 400 naming the field,
what it cannot do: images (also inside a `tool_result`: "image input is not supported", as
llama-server says without a vision projector), documents and other non-text blocks, server tools
(web search, code execution, ...), an assistant message last (prefill: the chat path always opens a
new assistant turn). An empty `messages` array is accepted, as llama-server does: the
chat path renders what there is (the system prompt, then the generation prompt).
`cache_control` is accepted where Anthropic accepts it (at most `MAX_CACHE_BREAKPOINTS` blocks, each
`{"type": "ephemeral"}` with an optional `ttl`) and otherwise ignored: the engine reuses every
prompt prefix it holds, marked or not. The conversation is translated to chat messages on the way:
- a user message's `tool_result` blocks become `tool` messages (an `is_error` result says so in
  its text), its text blocks one user message after them;
- an assistant message's `thinking` blocks become `reasoning_content` (`redacted_thinking` is
  dropped: nothing can read it), its text the content, its `tool_use` blocks `tool_calls` (the
  input object as a JSON text);
- a mid-conversation `system` message (Claude Opus 4.8's; Claude Code sends its agent and skill
  listings as one) becomes a chat `system` message at its place, its text blocks joined.
`thinking` {enabled|disabled} becomes the template's `enable_thinking` (`adaptive` leaves the
template's default); `budget_tokens` (any size, as llama-server takes it, below `max_tokens`) is
not enforced: thinking counts against `max_tokens`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict

from engine_pool.errors import BadRequest
from engine_pool.http.body import Body, json_type

from ..bounds import array_form, check_count
from ..chat_types import ChatBody, ChatMessage, ChatTool, ChatToolCall, ChatToolChoice, chat_request
from ..engine_options import engine_options, merge_template_kwargs
from ..tools import tool_name, tools_of_type

# Block types by the role that may send them.
USER_BLOCKS = ("text", "tool_result")
ASSISTANT_BLOCKS = ("text", "tool_use", "thinking", "redacted_thinking")
MAX_CACHE_BREAKPOINTS = 4  # Anthropic's limit on blocks with `cache_control`
CACHE_TTLS = ("5m", "1h")
TOOL_CHOICES = ("auto", "any", "tool", "none")
THINKING_TYPES = ("enabled", "disabled", "adaptive")


class Tool(TypedDict):
    """A client tool as read (the spec's `Tool`, less what this server ignores: `cache_control`, ...)."""

    name: str
    input_schema: dict[str, Any]  # the client's JSON schema
    description: NotRequired[str]


class ToolChoice(TypedDict):
    """`tool_choice` as read (the spec's ToolChoiceAuto, Any, Tool, None in one shape)."""

    type: str  # auto | any | tool | none
    name: NotRequired[str]  # tool
    disable_parallel_tool_use: NotRequired[bool]  # not with none


def _auto() -> ToolChoice:
    return {"type": "auto"}


@dataclass(frozen=True)
class MessagesRequest:
    model: str
    max_tokens: int | None  # None only in a count_tokens request
    messages: tuple[ChatMessage, ...]  # the conversation as chat messages
    system: str | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = field(default_factory=_auto)
    stop_sequences: tuple[str, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    thinking: bool | None = None  # None: the template's default
    output_schema: dict[str, Any] | None = None  # output_config.format's JSON schema
    metadata: dict[str, Any] = field(default_factory=dict)
    # Anthropic's cache diagnostics (`diagnostics.previous_message_id`): asked for (the id may be
    # null on a first turn), and that id.
    diagnostics: bool = False
    previous_message_id: str | None = None
    engine_options: Mapping[str, object] = field(default_factory=dict)  # llama-server extras, passed on

    @property
    def parallel_tool_calls(self) -> bool:
        return not self.tool_choice.get("disable_parallel_tool_use", False)


def parse_request(data: dict[str, Any], *, max_messages: int) -> MessagesRequest:
    """The request in `data`, or BadRequest naming the first malformed field."""
    body = Body(data)
    model = body.get_str("model")
    if not model:
        raise BadRequest("'model' is required", param="model")
    if not body.has("max_tokens"):
        raise BadRequest("'max_tokens' is required", param="max_tokens")
    return _parse(body, model, body.get_int("max_tokens", 0, lo=1), max_messages)


def parse_count_request(data: dict[str, Any], *, max_messages: int) -> MessagesRequest:
    """A `/v1/messages/count_tokens` body: a Messages request without `max_tokens` (or `stream`)."""
    body = Body(data)
    return _parse(body, body.get_str("model") or "", None, max_messages)


def _parse(body: Body, model: str, max_tokens: int | None, max_messages: int) -> MessagesRequest:
    _cache_breakpoints(body)
    tools = _tools(body)
    choice = _tool_choice(body, [t["name"] for t in tools])
    thinking = _thinking(body, max_tokens)
    meta = body.get_object("metadata")
    diagnostics, previous_message_id = _diagnostics(body)
    return MessagesRequest(
        model=model,
        max_tokens=max_tokens,
        messages=_messages(body, max_messages),
        system=_system(body, max_messages),
        tools=tools,
        tool_choice=choice,
        stop_sequences=_stop_sequences(body),
        temperature=body.get_float("temperature", 0.0, lo=0.0, hi=1.0) if body.has("temperature") else None,
        top_p=body.get_float("top_p", 0.0, lo=0.0, hi=1.0) if body.has("top_p") else None,
        top_k=body.get_int("top_k", 0, lo=0) if body.has("top_k") else None,
        stream=body.get_bool("stream", False),
        thinking=thinking,
        output_schema=_output_schema(body),
        metadata=dict(meta.data) if meta else {},
        engine_options=engine_options(body.data, "messages"),
        diagnostics=diagnostics,
        previous_message_id=previous_message_id,
    )


def _diagnostics(body: Body) -> tuple[bool, str | None]:
    """`diagnostics: {previous_message_id}` (Anthropic's cache diagnostics): whether it was asked
    for, and the id of this client's previous response (null on a first turn; at most 128
    characters)."""
    diagnostics = body.get_object("diagnostics")
    if diagnostics is None:
        return False, None
    previous = diagnostics.get_str("previous_message_id")
    if previous is not None and not 0 < len(previous) <= 128:
        raise BadRequest(
            "'diagnostics.previous_message_id' must be a message id of 1..128 characters",
            param="diagnostics.previous_message_id",
        )
    return True, previous


def _cache_breakpoints(body: Body) -> None:
    """`cache_control` markers: each `{"type": "ephemeral", "ttl"?}`, at most MAX_CACHE_BREAKPOINTS
    blocks (system, tools, message content, tool results' content), as Anthropic refuses more."""
    found = 0

    def check(block: Any, at: str) -> None:
        nonlocal found
        if not isinstance(block, dict) or block.get("cache_control") is None:
            return
        marker = block["cache_control"]
        ok = (
            isinstance(marker, dict)
            and marker.get("type") == "ephemeral"
            and marker.get("ttl", "5m") in CACHE_TTLS
        )
        if not ok:
            name = f"{at}.cache_control" if at else "cache_control"
            raise BadRequest(
                f"'{name}' must be {{\"type\": \"ephemeral\"}} with an optional 'ttl' of "
                f"{' or '.join(CACHE_TTLS)}",
                param=name,
            )
        found += 1

    def blocks(value: Any, at: str) -> None:
        if isinstance(value, list):
            for j, block in enumerate(value):
                check(block, f"{at}[{j}]")
                if isinstance(block, dict) and block.get("type") == "tool_result":
                    blocks(block.get("content"), f"{at}[{j}].content")

    top = body.raw("cache_control")
    if top is not None:
        check({"cache_control": top}, "")
        found -= 1  # the top-level marker is automatic caching, not a block
    blocks(body.raw("system"), "system")
    blocks(body.raw("tools"), "tools")
    messages = body.raw("messages")
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        if isinstance(m, dict):
            blocks(m.get("content"), f"messages[{i}].content")
    if found > MAX_CACHE_BREAKPOINTS:
        raise BadRequest(
            f"A maximum of {MAX_CACHE_BREAKPOINTS} blocks with cache_control may be provided. Found {found}.",
            param="cache_control",
        )


def _stop_sequences(body: Body) -> tuple[str, ...]:
    values = body.get_list("stop_sequences") or []
    for i, s in enumerate(values):
        if not isinstance(s, str) or not s:
            raise BadRequest(
                f"'stop_sequences[{i}]' must be a non-empty string, got {json_type(s)}",
                param=f"stop_sequences[{i}]",
            )
    return tuple(values)


def _thinking(body: Body, max_tokens: int | None) -> bool | None:
    thinking = body.get_object("thinking")
    if thinking is None:
        return None
    kind = thinking.get_choice("type", "", THINKING_TYPES)
    if kind != "enabled":
        return None if kind == "adaptive" else False
    if not thinking.has("budget_tokens"):
        raise BadRequest("'thinking.budget_tokens' is required when thinking is enabled", param="thinking")
    budget = thinking.get_int("budget_tokens", 0, lo=0)
    if max_tokens is not None and budget >= max_tokens:
        raise BadRequest(
            f"'thinking.budget_tokens' ({budget}) must be less than 'max_tokens' ({max_tokens})",
            param="thinking.budget_tokens",
        )
    return True


def _output_schema(body: Body) -> dict[str, Any] | None:
    config = body.get_object("output_config")
    fmt = config.get_object("format") if config else None
    if fmt is None:
        return None
    fmt.get_choice("type", "", ("json_schema",))
    schema = fmt.raw("schema")
    if not isinstance(schema, dict):
        raise BadRequest(
            f"'output_config.format.schema' must be a JSON schema object, got {json_type(schema)}",
            param="output_config.format.schema",
        )
    return schema


# -- tools --------------------------------------------------------------------------------------
_SERVER_TOOL = (
    "is a server tool, which this server does not run (client tools only: {name, description, input_schema})"
)


def _tools(body: Body) -> tuple[Tool, ...]:
    out: list[Tool] = []
    for tool in tools_of_type(body, "custom", "custom", _SERVER_TOOL):
        where = tool.path
        name = tool_name(tool, (t["name"] for t in out), "tool")
        schema = tool.get_object("input_schema")
        if schema is None:
            raise BadRequest(f"'{where}.input_schema' is required", param=f"{where}.input_schema")
        entry: Tool = {"name": name, "input_schema": schema.data}
        description = tool.get_str("description")
        if description is not None:
            entry["description"] = description
        out.append(entry)
    return tuple(out)


def _tool_choice(body: Body, names: list[str]) -> ToolChoice:
    choice = body.get_object("tool_choice")
    if choice is None:
        return _auto()
    kind = choice.get_choice("type", "", TOOL_CHOICES)
    out: ToolChoice = {"type": kind}
    if kind in ("any", "tool") and not names:
        raise BadRequest(f"'tool_choice' is {kind!r} but no 'tools' were given", param="tool_choice")
    if kind == "tool":
        name = choice.get_str("name")
        if name is None or name not in names:
            raise BadRequest(
                f"'tool_choice.name' names tool {name!r}, which is not among 'tools'",
                param="tool_choice.name",
            )
        out["name"] = name
    if kind != "none" and choice.has("disable_parallel_tool_use"):
        out["disable_parallel_tool_use"] = choice.get_bool("disable_parallel_tool_use", False)
    return out


# -- system and messages ------------------------------------------------------------------------
def _system(body: Body, max_blocks: int) -> str | None:
    raw = body.raw("system")
    if raw is None or isinstance(raw, str):
        return raw or None
    return _texts(raw, "system", max_blocks)


NO_IMAGES = "image input is not supported: this engine serves a text-only model"


def _texts(blocks: Any, where: str, max_blocks: int) -> str:
    """The text of an array of text blocks (a tool result's content, the system prompt)."""
    texts = []
    for j, block in enumerate(array_form(blocks, where, max_blocks, "text blocks", "blocks")):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "image":
            raise BadRequest(f"'{at}': {NO_IMAGES}", param=at)
        if kind != "text":
            raise _unsupported(at, kind, "text blocks only")
        texts.append(_block_text(Body(block, at), "text"))
    return "\n".join(texts)


def _unsupported(at: str, kind: Any, what: str) -> BadRequest:
    return BadRequest(f"'{at}': content block type {kind!r} is not supported here ({what})", param=at)


def _block_text(block: Body, key: str) -> str:
    text = block.raw(key)
    if not isinstance(text, str):
        where = block.name(key)
        raise BadRequest(f"'{where}' must be a string, got {json_type(text)}", param=where)
    return text


def _messages(body: Body, max_messages: int) -> tuple[ChatMessage, ...]:
    raw = body.get_list("messages")
    if raw is None:
        raise BadRequest("'messages' is required (an array of messages)", param="messages")
    check_count("messages", raw, max_messages, "messages")
    out: list[ChatMessage] = []
    for msg in body.objects("messages"):
        where = msg.path
        role = msg.get_str("role")
        if role not in ("user", "assistant", "system"):
            raise BadRequest(
                f"'{where}.role' must be user, assistant or system; got {role!r}", param=f"{where}.role"
            )
        content = msg.raw("content")
        if role == "system":  # a mid-conversation system message: a chat system message where it sits
            text = content if isinstance(content, str) else _texts(content, f"{where}.content", max_messages)
            out.append({"role": "system", "content": text})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        array_form(content, msg.name("content"), max_messages, "content blocks", "blocks")
        convert = _user if role == "user" else _assistant
        out.extend(convert(msg, max_messages))
    if out and out[-1]["role"] == "assistant":
        raise BadRequest(
            f"'messages[{len(raw) - 1}]': a conversation ending with an assistant message (prefill) is "
            "not supported by this server; end with a user message",
            param=f"messages[{len(raw) - 1}]",
        )
    return tuple(out)


def _blocks(msg: Body, allowed: tuple[str, ...], other: tuple[str, ...]) -> list[tuple[str, Body]]:
    """(type, block) of each block of the message's content, refusing types this role cannot send
    or this server cannot read."""
    out = []
    for block in msg.objects("content"):
        at = block.path
        kind = block.raw("type")
        if kind == "image":
            raise BadRequest(f"'{at}': {NO_IMAGES}", param=at)
        if kind not in allowed:
            if kind in other:
                raise BadRequest(f"'{at}': a {kind!r} block does not belong in this role's message", param=at)
            raise _unsupported(at, kind, f"this server reads {', '.join(allowed)} blocks in this role")
        out.append((kind, block))
    return out


def _user(msg: Body, max_blocks: int) -> list[ChatMessage]:
    """Tool results first (as `tool` messages), then the user's text."""
    tools: list[ChatMessage] = []
    texts = []
    for kind, result in _blocks(msg, USER_BLOCKS, ASSISTANT_BLOCKS):
        at = result.path
        if kind == "text":
            texts.append(_block_text(result, "text"))
            continue
        tool_use_id = result.get_str("tool_use_id")
        if not tool_use_id:
            raise BadRequest(f"'{at}.tool_use_id' must be a non-empty string", param=f"{at}.tool_use_id")
        raw = result.raw("content", "")
        text = raw if isinstance(raw, str) else _texts(raw, f"{at}.content", max_blocks)
        if result.get_bool("is_error", False):
            text = f"Error: {text}"
        tools.append({"role": "tool", "tool_call_id": tool_use_id, "content": text})
    if texts or not tools:
        tools.append({"role": "user", "content": "\n".join(texts)})
    return tools


def _assistant(msg: Body, max_blocks: int) -> list[ChatMessage]:
    texts, thoughts = [], []
    calls: list[ChatToolCall] = []
    for kind, use in _blocks(msg, ASSISTANT_BLOCKS, USER_BLOCKS):
        at = use.path
        if kind == "text":
            texts.append(_block_text(use, "text"))
        elif kind == "thinking":
            thoughts.append(_block_text(use, "thinking"))
        elif kind == "tool_use":
            call_id, name = use.get_str("id"), use.get_str("name")
            if not call_id or not name:
                raise BadRequest(f"'{at}' needs a non-empty 'id' and 'name'", param=at)
            tool_input = use.get_object("input")
            arguments = json.dumps(tool_input.data if tool_input else {}, ensure_ascii=False)
            calls.append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            )
    message: ChatMessage = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return [message]


# -- chat body ----------------------------------------------------------------------------------
def chat_tool_choice(choice: ToolChoice) -> ChatToolChoice:
    kind = choice["type"]
    if kind == "tool":
        return {"type": "function", "function": {"name": choice["name"]}}
    return {"auto": "auto", "any": "required", "none": "none"}[kind]


def chat_tool(tool: Tool) -> ChatTool:
    out: ChatTool = {
        "type": "function",
        "function": {"name": tool["name"], "parameters": tool["input_schema"]},
    }
    if tool.get("description"):
        out["function"]["description"] = tool["description"]
    return out


def chat_body(req: MessagesRequest) -> dict[str, Any]:
    """The chat completions body for `req`: [system] + the conversation; a stream asks for usage,
    which the Messages stream reports in its `message_delta`."""
    system: list[ChatMessage] = [{"role": "system", "content": req.system}] if req.system else []
    body: ChatBody = {"model": req.model, "messages": system + list(req.messages)}
    if req.max_tokens is not None:
        body["max_tokens"] = req.max_tokens
    if req.tools:
        body["tools"] = [chat_tool(t) for t in req.tools]
        body["tool_choice"] = chat_tool_choice(req.tool_choice)
    if req.stop_sequences:
        body["stop"] = list(req.stop_sequences)
    if req.temperature is not None:
        body["temperature"] = req.temperature
    if req.top_p is not None:
        body["top_p"] = req.top_p
    if req.top_k is not None:
        body["top_k"] = req.top_k
    if req.output_schema is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": req.output_schema},
        }
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    options = req.engine_options
    if req.thinking is not None:
        options = merge_template_kwargs(options, {"enable_thinking": req.thinking})
    return chat_request(body, options)

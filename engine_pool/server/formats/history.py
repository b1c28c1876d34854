"""A conversation as a chat template expects it: every message in one well-formed shape, and what
the template cannot write written for it (llama.cpp's chat layer and its polyfills).

`normalise` gives each message the shape llama.cpp hands its templates — `role`; `content` always
present, "" where a client sent none or null (an assistant turn with only tool calls);
`reasoning_content` only when it holds text; `name` and `tool_call_id` when given; `tool_calls` as
`{id, type: "function", function: {name, arguments}}` — and then, by the template's capabilities
(`template_caps.TemplateCaps`):

- arguments as a mapping for a template that iterates them, as JSON text for one that writes text
  (a JSON object text is parsed; any other text is left for the template to write or refuse);
- content as a string, or as text parts, whichever the template takes (parts join with newlines);
- `developer` is `system` (only gpt-oss's harmony templates know the developer role);
- a template without a system role gets the leading system text at the top of the next message;
- a template that writes no tools gets them described in the system text, with the call syntax
  the engine reads (the chat format's `write_calls`; `hermes`, JSON in `<tool_call>` tags, for a
  template of no family); one that writes no tool calls gets them in that syntax after the
  assistant's text; one that writes no tool messages gets the results as
  a user message of `<tool_response>` blocks (consecutive results, and the user message that
  follows them, in one message).
Nothing is dropped. The caller's messages are not changed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NotRequired, TypedDict

from ..template_caps import TemplateCaps
from . import hermes
from .calls import loads_json

WriteCalls = Callable[[Sequence[tuple[str, Any]]], str]

_RESPONSE_OPEN, _RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


class TextPart(TypedDict):
    type: Literal["text"]
    text: str


class TemplateFunction(TypedDict):
    name: Any  # the client's (a string, once engine_pool.server.chat_request checked it)
    arguments: Any  # a mapping for a template that iterates them, JSON text for one that writes text


class TemplateToolCall(TypedDict):
    id: NotRequired[str]
    type: Literal["function"]
    function: TemplateFunction


class TemplateMessage(TypedDict):
    """A message as `normalise` hands it to a template (llama.cpp's shape; see the module)."""

    role: Any  # the client's (a non-empty string, once chat_request checked it)
    content: str | Sequence[Mapping[str, Any]]  # text, or the client's parts (or `TextPart`s)
    reasoning_content: NotRequired[str]
    name: NotRequired[str]
    tool_call_id: NotRequired[str]
    tool_calls: NotRequired[list[TemplateToolCall]]


def normalise(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    caps: TemplateCaps,
    *,
    developer_role: bool = False,
    write_calls: WriteCalls = hermes.write_calls,
) -> list[TemplateMessage]:
    """`messages` in the one shape templates get, with `caps`' gaps filled (see the module)."""
    out = [_canonical(m, caps, developer_role) for m in messages]
    if tools and not caps.tools:
        out = _with_tools_described(out, tools, write_calls)
    if not caps.tool_calls:
        out = [_calls_in_content(m, write_calls) for m in out]
    if not caps.tool_results:
        out = _results_as_user(out)
    if not caps.system_role:
        out = _system_merged(out)
    if not caps.string_content:
        out = [_as_parts(m) for m in out]
    return out


def _as_parts(m: TemplateMessage) -> TemplateMessage:
    content = m["content"]
    if not isinstance(content, str):
        return m
    part: TextPart = {"type": "text", "text": content}
    return {**m, "content": [part]}


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return ""


def _canonical(m: Mapping[str, Any], caps: TemplateCaps, developer_role: bool) -> TemplateMessage:
    role = m.get("role")
    if role == "developer" and not developer_role:
        role = "system"
    content = m.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list) and not caps.typed_content:
        content = _text(content)
    out: TemplateMessage = {"role": role, "content": content}
    if isinstance(m.get("reasoning_content"), str) and m["reasoning_content"]:
        out["reasoning_content"] = m["reasoning_content"]
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    if isinstance(m.get("tool_call_id"), str):
        out["tool_call_id"] = m["tool_call_id"]
    calls = m.get("tool_calls")
    if isinstance(calls, list) and calls:
        out["tool_calls"] = [_call(c, caps.object_arguments) for c in calls]
    return out


def _call(call: Mapping[str, Any], object_arguments: bool) -> TemplateToolCall:
    fn = call.get("function") or {}
    args = fn.get("arguments", {})
    if object_arguments and isinstance(args, str):
        try:
            parsed = loads_json(args)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            args = parsed
    elif not object_arguments and not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    function: TemplateFunction = {"name": fn.get("name", ""), "arguments": args}
    if isinstance(call.get("id"), str):
        return {"id": call["id"], "type": "function", "function": function}
    return {"type": "function", "function": function}


def _object(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return loads_json(args)
        except ValueError:
            return args
    return args


def _with_tools_described(
    messages: list[TemplateMessage], tools: Sequence[Mapping[str, Any]], write_calls: WriteCalls
) -> list[TemplateMessage]:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    example = write_calls([("<function-name>", {"<argument>": "<value>"})])
    text = (
        "You may call one or more functions to assist with the user query. The functions:\n"
        f"{listed}\n\nTo call a function, write the call this way:\n{example}"
    )
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{_text(first['content'])}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _calls_in_content(m: TemplateMessage, write_calls: WriteCalls) -> TemplateMessage:
    calls = m.get("tool_calls")
    if not calls:
        return m
    text = write_calls([(c["function"]["name"], _object(c["function"]["arguments"])) for c in calls])
    head = _text(m["content"])
    rest = m.copy()
    del rest["tool_calls"]
    return {**rest, "content": f"{head}\n{text}" if head else text}


def _results_as_user(messages: list[TemplateMessage]) -> list[TemplateMessage]:
    out: list[TemplateMessage] = []
    results = False  # the last message of `out` is results written as a user message
    for m in messages:
        if m["role"] == "tool":
            block = f"{_RESPONSE_OPEN}\n{_text(m['content'])}\n{_RESPONSE_CLOSE}"
            if results:
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{block}"}
            else:
                out.append({"role": "user", "content": block})
            results = True
        elif results and m["role"] == "user":
            # The user's next words join the results: two user turns in a row break templates that
            # alternate roles.
            out[-1] = {**m, "content": f"{out[-1]['content']}\n{_text(m['content'])}"}
            results = False
        else:
            out.append(m)
            results = False
    return out


def _system_merged(messages: list[TemplateMessage]) -> list[TemplateMessage]:
    if not messages or messages[0]["role"] != "system":
        return messages
    system = _text(messages[0]["content"])
    if len(messages) == 1:
        return [{"role": "user", "content": system}]
    nxt = messages[1]
    return [{**nxt, "content": f"{system}\n{_text(nxt['content'])}"}, *messages[2:]]

"""The Responses API's tools and `tool_choice`, as OpenAI's published spec defines them (`Tool`),
and how the model sees them. Pure.

- `function` tools are offered as chat function tools.
- `custom` tools (free-form input; `format` text, or a grammar: lark or regex) are offered as chat
  function tools whose one parameter `input` is that text; a grammar is read here
  (engine_pool.protocol.tool_grammar: what it cannot enforce is a 400 naming the definition) and
  travels in the chat tool's `input_grammar`, which the engine enforces on every call of the tool.
  A call answers a `custom_tool_call` item whose `input` is the call's text.
- `namespace` tools group function and custom tools. The model sees each under its *model name*,
  `NAMESPACE.NAME` (`model_name`): deterministic, so a replayed call renders the prompt it was
  generated from, and out of the way of plain tools (the spec's function names have no `.`); a
  model name that another tool of the request already has is refused, naming both. A call answers
  its item with the `namespace` field; items sent back with one are named the same way.
- Hosted tools (`HOSTED`: every other type the spec lists) run on OpenAI's servers; this one cannot
  run them. `hosted="omit"` (the default; gateway.tenants `hosted_tools`) leaves them out of the
  prompt and lists them (`Omitted`) for the answer to say so; `"refuse"` answers a 400 naming the
  tool. A type the spec does not list is a 400.

Bounds (each a 400 naming the field): namespaces per request, tools per namespace, the length of a
namespace's name; a namespace inside a namespace is refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from engine_pool.errors import BadRequest
from engine_pool.http.body import Body, json_type

from ..bounds import check_count
from ..chat_types import ChatFunction, ChatTool, ChatToolChoice
from ..tool_grammar import parse_grammar
from ..tools import tool_choice_mode
from .objects import (
    CustomFormat,
    CustomTextFormat,
    CustomToolEcho,
    FunctionToolEcho,
    NamedToolChoice,
    NamespaceEcho,
    ToolChoice,
    ToolEcho,
)

SEPARATOR = "."
MAX_NAMESPACES = 32
MAX_NAMESPACE_TOOLS = 128
MAX_NAMESPACE_CHARS = 128
HOSTED_POLICIES = ("omit", "refuse")

# The tool types of the spec's `Tool` that OpenAI runs itself (not function, custom, namespace).
HOSTED = (
    "file_search",
    "computer",
    "computer_use",
    "computer_use_preview",
    "web_search",
    "web_search_2025_08_26",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "mcp",
    "code_interpreter",
    "image_generation",
    "local_shell",
    "shell",
    "tool_search",
    "apply_patch",
)
# A custom tool's arguments as the chat path sees them: one string, its input.
INPUT_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"input": {"type": "string"}},
    "required": ["input"],
}


def _free_text() -> CustomTextFormat:
    """A custom tool's `format` when it sets none: free text."""
    return {"type": "text"}


def model_name(namespace: str | None, name: str) -> str:
    """The name the model sees a tool (and writes its calls) under."""
    return f"{namespace}{SEPARATOR}{name}" if namespace else name


@dataclass(frozen=True)
class Offered:
    """A function or custom tool the model is offered."""

    kind: str  # function | custom
    name: str
    where: str  # the request's field: tools[i], or tools[i].tools[j] in a namespace
    namespace: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None  # function
    strict: bool | None = None  # function
    format: CustomFormat = field(default_factory=_free_text)  # custom

    @property
    def model_name(self) -> str:
        return model_name(self.namespace, self.name)

    def echo(self, description: str | None = None) -> FunctionToolEcho | CustomToolEcho:
        """As the response's `tools` shows it, with `description` (default: the one the model sees;
        a namespaced tool's own inside its namespace's)."""
        if description is None:
            description = self.description
        if self.kind == "custom":
            out: CustomToolEcho = {"type": "custom", "name": self.name, "format": self.format}
            if description is not None:
                out["description"] = description
            return out
        return {
            "type": "function",
            "name": self.name,
            "description": description,
            "parameters": self.parameters,
            "strict": self.strict,
        }


@dataclass(frozen=True)
class Omitted:
    """A hosted tool left out of the prompt (hosted="omit")."""

    type: str
    where: str

    def report(self) -> dict[str, str]:
        return {"type": self.type, "param": self.where}


@dataclass(frozen=True)
class Tools:
    offered: tuple[Offered, ...] = ()
    echo: tuple[ToolEcho, ...] = ()  # the response's `tools`: function, custom, namespace
    omitted: tuple[Omitted, ...] = ()

    def named(self, name: str) -> Offered | None:
        """The offered tool the model calls `name` (its model name)."""
        return next((t for t in self.offered if t.model_name == name), None)


def parse_tools(body: Body, hosted: str, max_tools: int) -> Tools:
    """`tools` (none when absent), or BadRequest naming the first malformed or refused entry."""
    raw = body.get_list("tools") or []
    check_count("tools", raw, max_tools, "tools")
    offered: list[Offered] = []
    echo: list[ToolEcho] = []
    omitted: list[Omitted] = []
    namespaces = 0
    for tool in body.objects("tools"):
        kind = _kind(tool)
        if kind in HOSTED:
            if hosted == "refuse":
                raise BadRequest(
                    f"'{tool.path}': the hosted tool {kind!r} runs on OpenAI's servers, not on this one "
                    "(this tenant's hosted_tools is 'refuse'; with 'omit' it is left out of the prompt)",
                    param=tool.path,
                )
            omitted.append(Omitted(kind, tool.path))
        elif kind == "namespace":
            namespaces += 1
            if namespaces > MAX_NAMESPACES:
                raise BadRequest(
                    f"'{tool.path}': a request holds at most {MAX_NAMESPACES} namespaces",
                    param=tool.path,
                    extra={"limit": MAX_NAMESPACES},
                )
            inner = _namespace(tool, offered)
            offered += inner
            echo.append(_namespace_echo(tool, inner))
        else:
            entry = _tool(tool, kind, None, offered)
            offered.append(entry)
            echo.append(entry.echo())
    check_count("tools", offered, max_tools, "tools (namespaces' tools included)")
    return Tools(tuple(offered), tuple(echo), tuple(omitted))


def _kind(tool: Body) -> str:
    kind = tool.get_str("type", "function")
    assert kind is not None
    if kind in ("function", "custom", "namespace") or kind in HOSTED:
        return kind
    raise BadRequest(
        f"'{tool.path}': unknown tool type {kind!r} (function, custom, namespace, or one of OpenAI's "
        f"hosted tools: {', '.join(HOSTED)})",
        param=tool.path,
    )


def _namespace(tool: Body, taken: list[Offered]) -> list[Offered]:
    name = tool.get_str("name")
    where = tool.name("name")
    if not name:
        raise BadRequest(f"'{where}' must be a non-empty string", param=where)
    if len(name) > MAX_NAMESPACE_CHARS:
        raise BadRequest(
            f"'{where}' has {len(name)} characters; at most {MAX_NAMESPACE_CHARS} are accepted",
            param=where,
            extra={"limit": MAX_NAMESPACE_CHARS},
        )
    description = tool.get_str("description")
    inner = tool.get_list("tools")
    if not inner:
        raise BadRequest(
            f"'{tool.name('tools')}' must be a non-empty array of function and custom tools",
            param=tool.name("tools"),
        )
    if len(inner) > MAX_NAMESPACE_TOOLS:
        raise BadRequest(
            f"'{tool.name('tools')}' has {len(inner)} tools; a namespace holds at most {MAX_NAMESPACE_TOOLS}",
            param=tool.name("tools"),
            extra={"limit": MAX_NAMESPACE_TOOLS},
        )
    out: list[Offered] = []
    for sub in tool.objects("tools"):
        kind = sub.get_str("type", "function")
        if kind not in ("function", "custom"):
            what = "a namespace cannot hold a namespace" if kind == "namespace" else f"tool type {kind!r}"
            raise BadRequest(
                f"'{sub.path}': {what}; a namespace holds function and custom tools only", param=sub.path
            )
        entry = _tool(sub, kind, name, [*taken, *out])
        if description:  # the namespace's description is shown to the model with each of its tools
            joined = f"{description}\n\n{entry.description}" if entry.description else description
            entry = replace(entry, description=joined)
        out.append(entry)
    return out


def _namespace_echo(tool: Body, inner: list[Offered]) -> NamespaceEcho:
    # Each tool with its own description, not the one the model sees.
    tools = [
        entry.echo(sub.get_str("description")) if sub.has("description") else _undescribed(entry)
        for entry, sub in zip(inner, tool.objects("tools"), strict=True)
    ]
    return {
        "type": "namespace",
        "name": tool.get_str("name"),
        "description": tool.get_str("description"),
        "tools": tools,
    }


def _undescribed(entry: Offered) -> FunctionToolEcho | CustomToolEcho:
    echoed = entry.echo()
    if echoed["type"] == "custom":
        echoed.pop("description", None)
    else:
        echoed["description"] = None
    return echoed


def _tool(tool: Body, kind: str, namespace: str | None, taken: Iterable[Offered]) -> Offered:
    if kind == "function" and tool.has("function") and not tool.has("name"):
        raise BadRequest(
            f"'{tool.path}' is in the Chat Completions shape; Responses tools are flat: "
            '{"type": "function", "name": ..., "parameters": {...}}',
            param=tool.path,
        )
    name = tool.get_str("name")
    where = tool.name("name")
    if not name:
        raise BadRequest(f"'{where}' must be a non-empty string", param=where)
    seen = model_name(namespace, name)
    for other in taken:
        if other.model_name == seen:
            raise BadRequest(
                f"'{where}': the model would see this tool as {seen!r}, as it sees '{other.where}'"
                + (f" ({other.name!r} of namespace {other.namespace!r})" if other.namespace else "")
                + "; tool names must be unique",
                param=where,
            )
    description = tool.get_str("description")
    if kind == "custom":
        return Offered("custom", name, tool.path, namespace, description, format=_format(tool))
    params = tool.get_object("parameters")
    strict = tool.get_bool("strict", False) if tool.has("strict") else None
    parameters = params.data if params else None
    return Offered("function", name, tool.path, namespace, description, parameters, strict)


def _format(tool: Body) -> CustomFormat:
    """A custom tool's `format`: text, or a grammar the engine can enforce (read here, so that
    what it cannot enforce is refused before any work)."""
    fmt = tool.get_object("format")
    if fmt is None:
        return _free_text()
    kind = fmt.get_choice("type", "text", ("text", "grammar"))
    if kind == "text":
        return _free_text()
    syntax = fmt.get_choice("syntax", "", ("lark", "regex")) if fmt.has("syntax") else None
    definition = fmt.get_str("definition")
    if syntax is None or definition is None:
        missing = fmt.name("syntax") if syntax is None else fmt.name("definition")
        raise BadRequest(f"'{missing}' is required for a grammar format", param=missing)
    parse_grammar(syntax, definition, fmt.name("definition"))
    return {"type": "grammar", "syntax": syntax, "definition": definition}


def has_grammar(tool: Offered) -> bool:
    return tool.kind == "custom" and tool.format["type"] == "grammar"


def parse_tool_choice(body: Body, tools: Tools) -> ToolChoice:
    """`tool_choice`: auto | none | required, or a function or custom tool by its model name."""
    raw = body.raw("tool_choice", "auto")
    names = [t.model_name for t in tools.offered]
    if isinstance(raw, str):
        return tool_choice_mode(raw, ("auto", "none", "required"), names)
    if not isinstance(raw, dict):
        raise BadRequest(
            f"'tool_choice' must be a string or an object, got {json_type(raw)}", param="tool_choice"
        )
    kind = raw.get("type")
    if kind in HOSTED:
        raise BadRequest(
            f"'tool_choice' names the hosted tool {kind!r}, which runs on OpenAI's servers, not on this one",
            param="tool_choice",
        )
    if kind not in ("function", "custom"):
        raise BadRequest(
            f"'tool_choice': type {kind!r} is not supported by this server "
            '(auto, none, required, {"type": "function", "name": ...} or {"type": "custom", "name": ...})',
            param="tool_choice",
        )
    name = raw.get("name")
    tool = tools.named(name) if isinstance(name, str) else None
    if tool is None or tool.kind != kind:
        noun = "function" if kind == "function" else "custom tool"
        raise BadRequest(
            f"'tool_choice' names {noun} {name!r}, which is not among 'tools' (a namespace's tools by "
            f"their model name, NAMESPACE{SEPARATOR}NAME)",
            param="tool_choice",
        )
    named: NamedToolChoice = {"type": kind, "name": tool.model_name}  # (the name asked for)
    return named


def check_grammars_with_format(tools: Tools, tool_choice: ToolChoice, text_format: str) -> None:
    """A grammar-constrained custom tool under tool_choice auto holds the model's calls to a grammar
    from their first tag on, which a constrained reply (`text.format`) cannot share: refused."""
    if tool_choice != "auto" or text_format == "text":
        return
    for tool in tools.offered:
        if has_grammar(tool):
            where = f"{tool.where}.format"
            raise BadRequest(
                f"'{where}': a custom tool's grammar cannot be combined with 'text.format' "
                f"{text_format!r} under tool_choice auto",
                param=where,
            )


# -- the chat path's view -------------------------------------------------------------------------
def chat_tools(tools: Tools) -> list[ChatTool]:
    """The offered tools as chat function tools, under their model names."""
    out: list[ChatTool] = []
    for tool in tools.offered:
        fn: ChatFunction = {"name": tool.model_name}
        if tool.description is not None:
            fn["description"] = tool.description
        if tool.kind == "custom":
            fn["parameters"] = INPUT_PARAMETERS
            entry: ChatTool = {"type": "function", "function": fn}
            if tool.format["type"] == "grammar":
                entry["input_grammar"] = {
                    "syntax": tool.format["syntax"],
                    "definition": tool.format["definition"],
                }
            out.append(entry)
            continue
        if tool.parameters is not None:
            fn["parameters"] = tool.parameters
        if tool.strict is not None:
            fn["strict"] = tool.strict
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: ToolChoice) -> ChatToolChoice:
    if isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def custom_arguments(text: str) -> str:
    """A custom tool call's input as the chat tool call's arguments (the text the engine's own
    reading of such a call gives, so that a replayed call renders the same prompt)."""
    return json.dumps({"input": text}, ensure_ascii=False)


def custom_input(arguments: str) -> str:
    """A custom tool call's input from the chat call's arguments: `input` when they are the object
    `custom_arguments` writes, else the one string they hold, else the arguments' text as it is."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict):
        if isinstance(value.get("input"), str):
            return str(value["input"])
        strings = [v for v in value.values() if isinstance(v, str)]
        if len(value) == 1 and strings:
            return strings[0]
    return arguments

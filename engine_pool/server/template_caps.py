"""What a chat template can write, found by rendering probe conversations (as llama.cpp's
`jinja::caps_get` does with its own engine's usage counters).

A probe carries marker texts where a template that writes a thing must put them: the system
message's text, a tool's description, a call's argument value, a tool result. A capability holds
when its probe renders and the marker appears in the output. Arguments are probed both as a JSON
object and as a JSON text: a template that wants objects reaches the values inside them (llama.cpp's
test: `arguments.arg` is used); one that wants text writes it as it is (and a mapping as its Python
repr). A template that only dumps the whole mapping (`tojson`) takes either: it gets the client's
text, so a call re-renders with the bytes the model wrote. `formats.history.normalise` fills in,
from these, what a template cannot write.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..protocol.chat_types import ChatMessage, ChatTool, ChatToolCall

Render = Callable[[Sequence[ChatMessage], Sequence[ChatTool] | None], str]

_SYSTEM = "SKPROBE-SYSTEM"
_USER = "SKPROBE-USER"
_TOOL_DESC = "SKPROBE-TOOL-DESCRIPTION"
_ARG = "SKPROBE-ARGUMENT"
_RESULT = "SKPROBE-RESULT"
_PROBE_TOOLS: list[ChatTool] = [
    {
        "type": "function",
        "function": {
            "name": "skprobe_tool",
            "description": _TOOL_DESC,
            "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"]},
        },
    }
]


@dataclass(frozen=True)
class TemplateCaps:
    string_content: bool = True  # content as a string
    typed_content: bool = False  # content as a list of text parts
    system_role: bool = True
    tools: bool = True  # writes the tools it is given
    tool_calls: bool = True  # writes an assistant's tool calls
    tool_results: bool = True  # writes a tool message
    object_arguments: bool = False  # wants a call's arguments as a mapping, not a JSON text


def _renders(render: Render, messages: list[ChatMessage], tools: list[ChatTool] | None = None) -> str | None:
    try:
        return render(messages, tools)
    except Exception:  # noqa: BLE001 — any failure of a probe only says the template cannot do it
        return None


def _tool_conversation(arguments: str | dict[str, str]) -> list[ChatMessage]:
    call: ChatToolCall = {
        "id": "call00001",
        "type": "function",
        "function": {"name": "skprobe_tool", "arguments": arguments},
    }
    return [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call00001", "name": "skprobe_tool", "content": _RESULT},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "v"},
    ]


def detect(render: Render) -> TemplateCaps:
    """The capabilities of the template behind `render` (messages, tools) -> text; it raises on a
    conversation the template refuses."""
    plain = _renders(render, [{"role": "user", "content": _USER}])
    parts = _renders(render, [{"role": "user", "content": [{"type": "text", "text": _USER}]}])
    string_content = plain is not None and _USER in plain
    typed_content = parts is not None and _USER in parts and "'type'" not in parts
    system = _renders(render, [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _USER}])

    as_text = json.dumps({"arg": _ARG})
    with_object = _renders(render, _tool_conversation({"arg": _ARG}), _PROBE_TOOLS)
    with_text = _renders(render, _tool_conversation(as_text), _PROBE_TOOLS)
    object_ok = with_object is not None and _ARG in with_object and "{'arg'" not in with_object
    text_ok = with_text is not None and _ARG in with_text and '\\"arg\\"' not in with_text
    # A template that reaches the value inside the mapping (not only a dump of the whole) wants it.
    iterated = object_ok and with_object is not None and as_text not in with_object
    rendered = [r for r in (with_object, with_text) if r is not None]
    return TemplateCaps(
        string_content=string_content or not typed_content,
        typed_content=typed_content,
        system_role=system is not None and _SYSTEM in system,
        tools=any(_TOOL_DESC in r for r in rendered),
        tool_calls=object_ok or text_ok,
        tool_results=any(_RESULT in r for r in rendered),
        object_arguments=iterated or (object_ok and not text_ok),
    )

"""Hermes tool calls: JSON inside `<tool_call>` tags (Qwen2.5, Qwen3, Hermes 2/3, Granite 4.0).

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A block whose JSON is not `{"name": ..., "arguments": ...}` (`parameters` is accepted for
`arguments`, as some fine-tunes write it) is not a call. The forced-call grammar is
`grammar.hermes_call`, the engine's first format.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..grammar import hermes_call
from .calls import ToolCall, arguments_json, loads_json

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
call_grammar = hermes_call


def parse_call(block: str) -> ToolCall | None:
    """The call in the text between the tags, or None when it is not one."""
    try:
        data = loads_json(block)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    args = data.get("arguments", data.get("parameters", {}))
    return ToolCall(data["name"], args if isinstance(args, str) else arguments_json(args))


def parse_block(block: str, schemas: Mapping[str, Any]) -> list[ToolCall] | None:
    """The block's call (JSON carries its own types: the tools' schemas are not needed)."""
    call = parse_call(block)
    return [call] if call is not None else None


def write_calls(calls: Sequence[tuple[str, Any]]) -> str:
    """Calls ((name, arguments) pairs) as a model of the family writes them, for a template that
    has no syntax of its own for them."""
    return "\n".join(
        f"{OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{CLOSE}"
        for name, args in calls
    )

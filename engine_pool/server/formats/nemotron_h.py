"""Nemotron-H tool calls (Nemotron Nano v2): a JSON list of calls inside `<TOOLCALL>` tags.

    <TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]</TOOLCALL>

NVIDIA's template writes past calls this way and lists the tools as JSON in the system turn. A
block whose JSON is not a list of `{"name": ..., "arguments": ...}` objects is not a call block.
The forced-call grammar writes one call in a one-item list.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..grammar import GrammarBuilder, literal
from .calls import ToolCall, arguments_json, loads_json

OPEN = "<TOOLCALL>"
CLOSE = "</TOOLCALL>"
MARKERS = ((OPEN, CLOSE),)


def parse_block(block: str, schemas: Mapping[str, Any]) -> list[ToolCall] | None:
    """The calls of the block (JSON carries its own types: the schemas are not needed)."""
    try:
        data = loads_json(block)
    except ValueError:
        return None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list) or not data:
        return None
    calls = []
    for item in data:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            return None
        args = item.get("arguments", {})
        calls.append(ToolCall(item["name"], args if isinstance(args, str) else arguments_json(args)))
    return calls


def call_grammar(b: GrammarBuilder, name: str, args: Any) -> str:
    """One call: `<TOOLCALL>[{"name": NAME, "arguments": {...}}]</TOOLCALL>`."""
    head = literal(OPEN + '[{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ')
    return f"{head} {b.visit(args, '', f'args-{name}')} {literal('}]' + CLOSE)}"


def write_calls(calls: Sequence[tuple[str, Any]]) -> str:
    """Calls ((name, arguments) pairs) in one block, as the template writes them."""
    items = ", ".join(json.dumps({"name": n, "arguments": a}, ensure_ascii=False) for n, a in calls)
    return f"{OPEN}[{items}]{CLOSE}"

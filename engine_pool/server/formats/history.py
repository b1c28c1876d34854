"""A conversation's history as chat templates expect it.

OpenAI clients send an assistant's past tool calls with `function.arguments` as a JSON string;
real templates iterate the arguments (`tool_call.arguments|items` in Qwen3.5's, `.items()` in
LFM2's) and fail on a string. So a string holding a JSON object is handed to the template as that
object; any other string (not JSON, or JSON that is not an object) is left as it is, for the
template to write or refuse. `reasoning_content` of assistant messages stays in place: templates
that keep reasoning in history (the turns after the last user message, or all of them when asked)
read it from there. The caller's messages are not changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .calls import loads_json


def prepare_history(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with assistant tool-call arguments given as JSON object texts parsed."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and isinstance(calls, list) and calls:
            m = {**m, "tool_calls": [_with_object_arguments(c) for c in calls]}
        out.append(m)
    return out


def _with_object_arguments(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(args := fn.get("arguments"), str):
        return call
    try:
        parsed = loads_json(args)
    except ValueError:
        return call
    if not isinstance(parsed, dict):
        return call
    return {**call, "function": {**fn, "arguments": parsed}}

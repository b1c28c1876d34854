"""Anthropic Message objects from chat completions, as the anthropic SDK parses them. Pure.

Content blocks in order: `thinking` (the reasoning, with an empty `signature`: nothing here signs
it), `text`, one `tool_use` per tool call (only the first with `disable_parallel_tool_use`; the id
is the chat call id with Anthropic's `toolu_` prefix; `input` the parsed arguments). `stop_reason`:
tool_use, max_tokens (the limit), stop_sequence (with the `stop_sequence` that matched, from the
chat choice's `stopping_word`) or end_turn. Usage as Anthropic counts it: `input_tokens` are the
prompt tokens computed, `cache_read_input_tokens` those the engine reused, nothing is ever written
to a cache on request (`cache_creation_input_tokens` 0).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal, NotRequired, TypedDict

from ..chat_result import Call, ChatResult, Usage, read_completion
from .request import MessagesRequest


class MessageUsage(TypedDict):
    """The spec's `Usage`, less what this server has none of (server tools, ...)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int


class ThinkingBlock(TypedDict):
    type: Literal["thinking"]
    thinking: str
    signature: str


class TextBlock(TypedDict):
    type: Literal["text"]
    text: str


class ToolUseBlock(TypedDict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]  # the model's arguments as read (JSON)


ContentBlock = ThinkingBlock | TextBlock | ToolUseBlock


class CacheMiss(TypedDict):
    """`diagnostics.cache_miss_reason`."""

    type: str  # previous_message_not_found | system_changed | tools_changed | messages_changed
    cache_missed_input_tokens: NotRequired[int]


class Diagnostics(TypedDict):
    cache_miss_reason: CacheMiss | None


class MessageObject(TypedDict):
    """A Message (`type: "message"`), as this server writes it."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessageUsage
    slotkeeper: NotRequired[Mapping[str, Any]]  # the engine's reuse report, passed on as it came
    diagnostics: NotRequired[Diagnostics]


def tool_use_id(call_id: str) -> str:
    """Anthropic's id for a chat tool call: the same token, `toolu_` instead of `call_`."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object `tool_use.input` must be. Arguments that are not a JSON
    object (a model that wrote something else) are kept whole, under `_raw_arguments`."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        value = None
    return value if isinstance(value, dict) else {"_raw_arguments": arguments}


def usage_object(u: Usage) -> MessageUsage:
    return {
        "input_tokens": max(0, u.prompt_tokens - u.cached_tokens),
        "output_tokens": u.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
    }


def stop_reason(finish_reason: str | None, stopping_word: str, has_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    if has_calls or finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if stopping_word:
        return "stop_sequence", stopping_word
    return "end_turn", None


def tool_use_block(call: Call) -> ToolUseBlock:
    return {
        "type": "tool_use",
        "id": tool_use_id(call.id),
        "name": call.name,
        "input": tool_input(call.arguments),
    }


def content_blocks(result: ChatResult, *, parallel_tool_calls: bool) -> list[ContentBlock]:
    out: list[ContentBlock] = []
    if result.reasoning:
        out.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
    if result.content:
        out.append({"type": "text", "text": result.content})
    calls = result.calls if parallel_tool_calls else result.calls[:1]
    out.extend(tool_use_block(c) for c in calls)
    return out


def message_shell(req: MessagesRequest, *, message_id: str, model: str) -> MessageObject:
    """A Message without content, stop reason or usage yet (a stream's `message_start`)."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": req.model or model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage_object(Usage()),
    }


def message_object(req: MessagesRequest, chat: Mapping[str, Any], *, message_id: str) -> MessageObject:
    """The complete Message for a `chat.completion` object."""
    result = read_completion(chat)
    model = chat.get("model")
    message = message_shell(req, message_id=message_id, model=model if isinstance(model, str) else "")
    reason, sequence = stop_reason(result.finish_reason, result.stopping_word, bool(result.calls))
    message["content"] = content_blocks(result, parallel_tool_calls=req.parallel_tool_calls)
    message["stop_reason"] = reason
    message["stop_sequence"] = sequence
    message["usage"] = usage_object(result.usage)
    report = chat.get("slotkeeper")
    if isinstance(report, dict):  # how the prompt's state was served (beside usage)
        message["slotkeeper"] = report
    if req.diagnostics:
        message["diagnostics"] = {"cache_miss_reason": cache_miss_reason(req, report, result.usage)}
    return message


# Where a prompt left the state it was compared with (`slotkeeper.diverged.part`) → Anthropic's
# cache-miss reason. A divergence in the last reply (re-rendered) is no miss.
_MISSES = {"system": "system_changed", "tools": "tools_changed", "message": "messages_changed"}


def cache_miss_reason(req: MessagesRequest, report: Any, usage: Usage) -> CacheMiss | None:
    """Anthropic's `diagnostics.cache_miss_reason` from the engine's report: what changed since the
    state this session's previous turn left (the comparison is with what the engine held, not with
    a stored fingerprint of `previous_message_id`). None: a first turn, or nothing missed."""
    if req.previous_message_id is None or not isinstance(report, dict):
        return None
    prefix, diverged = report.get("prefix"), report.get("diverged")
    if not isinstance(prefix, dict):  # nothing to compare with: this session held no state
        return {"type": "previous_message_not_found"}
    part = diverged.get("part") if isinstance(diverged, dict) else None
    if part not in _MISSES:
        return None
    held = int(prefix.get("prompt_tokens") or prefix.get("tokens") or 0)
    return {"type": _MISSES[part], "cache_missed_input_tokens": max(0, held - usage.cached_tokens)}

"""Responses items as chat messages, and a Responses request as a chat completions body. Pure.

One assistant turn of chat (reasoning_content, content, tool_calls) is several Responses items in
that order: a `reasoning` item, a `message` item, `function_call` and `custom_tool_call` items.
`items_to_messages` folds such a run back into one assistant message — both for a request's input
and for a stored response's output — so that a conversation continued with `previous_response_id`,
or replayed whole (`store: false`), renders exactly the tokens the engine generated and the slot's
state is reused: a call is named as the model saw its tool (`tools.model_name`: a namespaced one
as NAMESPACE.NAME), a custom call's input is the arguments the engine read it from. Item ids never
reach a message. `function_call_output` and `custom_tool_call_output` items become `tool` messages;
`developer` is the chat templates' `system`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..chat_types import (
    ChatBody,
    ChatJsonSchema,
    ChatMessage,
    ChatResponseFormat,
    ChatToolCall,
    chat_request,
)
from ..engine_options import merge_template_kwargs
from .objects import InputItem, ResponseFormat
from .request import ResponsesRequest
from .tools import chat_tool_choice, chat_tools, custom_arguments, model_name

# Where an item goes inside the assistant turn being built: an item at or before the stage already
# reached starts a new turn.
_REASONING, _CONTENT, _CALLS = 1, 2, 3


def _text(parts: Any, field: str = "text") -> str:
    if isinstance(parts, str):
        return parts
    texts = [p.get(field) or p.get("refusal") or "" for p in parts or [] if isinstance(p, dict)]
    return "\n".join(t for t in texts if isinstance(t, str))


def reasoning_text(item: Mapping[str, Any]) -> str:
    """A reasoning item's text: its reasoning content, else its summary."""
    return _text(item.get("content")) or "\n\n".join(
        p["text"] for p in item.get("summary") or [] if isinstance(p, dict) and isinstance(p.get("text"), str)
    )


def items_to_messages(items: Iterable[Mapping[str, Any]]) -> list[ChatMessage]:
    """Responses items (input or output: ours, or a stored response's as read back) as chat messages."""
    out: list[ChatMessage] = []
    turn: ChatMessage | None = None
    stage = 0

    def assistant(at: int) -> ChatMessage:
        """The assistant turn an item of stage `at` belongs to: the current one while items come in
        turn order (several calls share a turn), else a new one."""
        nonlocal turn, stage
        if turn is None or stage > at or (stage == at and at != _CALLS):
            turn = {"role": "assistant", "content": None}
            out.append(turn)
        stage = at
        return turn

    for item in items:
        kind = item.get("type", "message")
        if kind == "reasoning":
            text = reasoning_text(item)
            if text:
                assistant(_REASONING)["reasoning_content"] = text
        elif kind == "message" and item.get("role") == "assistant":
            assistant(_CONTENT)["content"] = _text(item.get("content"))
        elif kind in ("function_call", "custom_tool_call"):
            name = model_name(item.get("namespace"), str(item.get("name")))
            custom = kind == "custom_tool_call"
            arguments = custom_arguments(str(item.get("input"))) if custom else item["arguments"]
            call: ChatToolCall = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            assistant(_CALLS).setdefault("tool_calls", []).append(call)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            turn, stage = None, 0
            out.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output"))}
            )
        elif kind == "message":
            turn, stage = None, 0
            role = item["role"]
            out.append(
                {"role": "system" if role == "developer" else role, "content": _text(item.get("content"))}
            )
    return out


def input_messages(req: ResponsesRequest) -> list[ChatMessage]:
    """The request's input items as chat messages (not `instructions`: they do not carry over to a
    response that continues this one), as the gateway keeps a conversation."""
    return items_to_messages(req.items)


def output_messages(response: Mapping[str, Any]) -> list[ChatMessage]:
    """A Response's output items as chat messages, for the conversation a later turn continues."""
    output = response.get("output")
    items = [i for i in output if isinstance(i, dict)] if isinstance(output, list) else []
    return items_to_messages(items)


def input_item_list(req: ResponsesRequest) -> list[InputItem]:
    """The request's input items as `GET /v1/responses/{id}/input_items` lists them (oldest first)."""
    out = []
    for item in req.items:
        entry = item.copy()
        if entry["type"] != "reasoning":
            entry["status"] = "completed"
        out.append(entry)
    return out


def chat_response_format(fmt: ResponseFormat) -> ChatResponseFormat | None:
    if fmt["type"] == "json_schema":
        schema: ChatJsonSchema = {"name": fmt["name"], "schema": fmt["schema"]}
        if "strict" in fmt:
            schema["strict"] = fmt["strict"]
        if "description" in fmt:
            schema["description"] = fmt["description"]
        return {"type": "json_schema", "json_schema": schema}
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    return None


def merge_leading_system(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The system messages a conversation starts with as one (blank-line separated): `instructions`
    and the developer messages an agent sends first are one system prompt to a chat template, and
    many templates accept a system message only as the first message."""
    n = 0
    while n < len(messages) and messages[n]["role"] == "system":
        n += 1
    if n < 2:
        return list(messages)
    system: ChatMessage = {
        "role": "system",
        "content": "\n\n".join(m["content"] for m in messages[:n] if m["content"]),
    }
    return [system, *messages[n:]]


def chat_body(req: ResponsesRequest, history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The chat completions body for `req` after `history` (the chat messages of the responses it
    continues, as stored): [system: instructions] + history + the input, leading system messages
    merged; a stream asks for usage, which the Responses stream reports at its end. Reasoning
    effort "none" turns the template's thinking off."""
    system: list[ChatMessage] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: ChatBody = {
        "model": req.model,
        "messages": merge_leading_system([*system, *history, *items_to_messages(req.items)]),
    }
    if req.tools.offered:
        body["tools"] = chat_tools(req.tools)
        body["tool_choice"] = chat_tool_choice(req.tool_choice)
        body["parallel_tool_calls"] = req.parallel_tool_calls
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    if req.temperature is not None:
        body["temperature"] = req.temperature
    if req.top_p is not None:
        body["top_p"] = req.top_p
    if (fmt := chat_response_format(req.text_format)) is not None:
        body["response_format"] = fmt
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    options = req.engine_options
    if req.reasoning and req.reasoning["effort"] == "none":
        options = merge_template_kwargs(options, {"enable_thinking": False})
    return chat_request(body, options)

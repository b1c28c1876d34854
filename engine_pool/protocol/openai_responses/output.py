"""Response objects (`object: "response"`) from chat completions, as the OpenAI SDK parses them. Pure.

A chat completion becomes, in this order: a `reasoning` item when the model reasoned
(`reasoning_content`), a `message` item when it wrote content, one `function_call` item per tool
call (`call_id` = the chat tool call id; only the first when `parallel_tool_calls` is false). A
completion cut by the token limit is `status: "incomplete"` with `incomplete_details.reason =
"max_output_tokens"`. Usage: `input_tokens_details.cached_tokens` is the prompt the engine reused.
The request's settings are echoed (`instructions`, `tools`, `tool_choice`, `temperature`, ...).
"""

from __future__ import annotations

import secrets
from typing import Any

from ...common.errors import ApiError
from ..chat_result import Call, ChatResult, Usage, read_completion
from .request import ResponsesRequest


def usage_object(u: Usage) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def is_incomplete(finish_reason: str | None) -> bool:
    return finish_reason == "length"


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant message item; `text` None: no content part yet (a stream's item just added)."""
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [] if text is None else [text_part(text)],
    }


def call_item(item_id: str, call: Call, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


def response_shell(
    req: ResponsesRequest, *, response_id: str, created_at: int, model: str, status: str
) -> dict[str, Any]:
    """A Response with the request's settings echoed, no output and no usage yet."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": None,
        "model": req.model or model,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "prompt_cache_key": req.prompt_cache_key,
        "reasoning": req.reasoning or {"effort": None, "summary": None},
        "safety_identifier": req.safety_identifier,
        "store": req.store,
        "temperature": req.temperature,
        "text": {"format": req.text_format, **({"verbosity": req.verbosity} if req.verbosity else {})},
        "tool_choice": req.tool_choice,
        "tools": [dict(t) for t in req.tools],
        "top_p": req.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": req.user,
        "metadata": dict(req.metadata),
    }


def finalize(
    response: dict[str, Any], output: list[dict[str, Any]], finish_reason: str | None, u: Usage
) -> None:
    """Make `response` final: its output, completed or incomplete (the token limit), its usage."""
    incomplete = is_incomplete(finish_reason)
    response.update(
        status="incomplete" if incomplete else "completed",
        incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
        output=output,
        usage=usage_object(u),
    )


def mark_failed(response: dict[str, Any], output: list[dict[str, Any]], err: ApiError) -> None:
    """Make `response` a failed one: ResponseError's `code` is one of a fixed set."""
    code = "rate_limit_exceeded" if err.status == 429 else "server_error"
    response.update(status="failed", output=output, error={"code": code, "message": err.message})


def output_items(result: ChatResult, *, parallel_tool_calls: bool) -> list[dict[str, Any]]:
    # The token limit cuts the last item only (a stream closes each item as the next one starts).
    status = "incomplete" if is_incomplete(result.finish_reason) else "completed"
    out = []
    if result.reasoning:
        cut = status if not (result.content or result.calls) else "completed"
        out.append(reasoning_item(new_id("rs_"), result.reasoning, cut))
    if result.content:
        out.append(message_item(new_id("msg_"), result.content, status))
    calls = result.calls if parallel_tool_calls else result.calls[:1]
    out.extend(call_item(new_id("fc_"), c, "completed") for c in calls)
    return out


def response_object(
    req: ResponsesRequest, chat: dict[str, Any], *, response_id: str, created_at: int
) -> dict[str, Any]:
    """The complete Response for a `chat.completion` object."""
    result = read_completion(chat)
    model = chat.get("model")
    response = response_shell(
        req,
        response_id=response_id,
        created_at=created_at,
        model=model if isinstance(model, str) else "",
        status="in_progress",
    )
    output = output_items(result, parallel_tool_calls=req.parallel_tool_calls)
    finalize(response, output, result.finish_reason, result.usage)
    if isinstance(chat.get("slotkeeper"), dict):  # how the prompt's state was served (beside usage)
        response["slotkeeper"] = chat["slotkeeper"]
    return response

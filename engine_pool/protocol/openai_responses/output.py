"""Response objects (`object: "response"`) from chat completions, as the OpenAI SDK parses them. Pure.

A chat completion becomes, in this order: a `reasoning` item when the model reasoned
(`reasoning_content`), a `message` item when it wrote content, one item per tool call (`call_id` =
the chat tool call id; only the first when `parallel_tool_calls` is false): a `function_call`, with
the tool's `namespace` when it has one, or a `custom_tool_call` for a custom tool (its `input` read
from the call's arguments, `tools.custom_input`). A completion cut by the token limit is
`status: "incomplete"` with `incomplete_details.reason = "max_output_tokens"`. Usage:
`input_tokens_details.cached_tokens` is the prompt the engine reused. The request's settings are
echoed (`instructions`, `tools`, `tool_choice`, `temperature`, ...).

Beyond OpenAI's shape, `slotkeeper` says how the engine served the prompt, and which hosted tools
were left out of it (`omitted_tools`: [{type, param}]). A reasoning item carries `encrypted_content`
when the request asked for it (`include`) and the caller can seal (`seal`: the gateway's key, bound
to the tenant, gateway.sealing): a client that keeps nothing on the server (`store: false`) replays
it, and the prompt is rendered again from it.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from typing import Any

from engine_pool.errors import ApiError

from ..chat_result import Call, ChatResult, Usage, read_completion
from .objects import (
    CustomToolCallItem,
    FunctionCallItem,
    MessageItem,
    OutputItem,
    OutputText,
    ReasoningItem,
    ResponseObject,
    ResponseText,
    ResponseUsage,
)
from .request import ResponsesRequest
from .tools import custom_input

# Seals a reasoning text for `encrypted_content` (None: the caller keeps no key).
Seal = Callable[[str], str] | None
ENCRYPTED = "reasoning.encrypted_content"


def usage_object(u: Usage) -> ResponseUsage:
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


def reasoning_item(item_id: str, text: str, status: str, sealed: str | None = None) -> ReasoningItem:
    item: ReasoningItem = {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }
    if sealed is not None:
        item["encrypted_content"] = sealed
    return item


def sealer(req: ResponsesRequest, seal: Seal) -> Seal:
    """`seal` when the request asked for reasoning's `encrypted_content`, else None."""
    return seal if ENCRYPTED in req.include else None


def text_part(text: str) -> OutputText:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> MessageItem:
    """An assistant message item; `text` None: no content part yet (a stream's item just added)."""
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [] if text is None else [text_part(text)],
    }


def call_item(
    req: ResponsesRequest, item_id: str, call: Call, status: str
) -> FunctionCallItem | CustomToolCallItem:
    """The item for a chat tool call: named as the request's tools name it (`call.name` is the
    model's name for it), a custom tool's with its input; a name no tool has is a function's."""
    tool = req.tools.named(call.name)
    if tool is None:
        return {
            "id": item_id,
            "type": "function_call",
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
            "status": status,
        }
    if tool.kind == "custom":  # (the spec's CustomToolCall has no status)
        custom: CustomToolCallItem = {
            "id": item_id,
            "type": "custom_tool_call",
            "call_id": call.id,
            "name": tool.name,
            "input": custom_input(call.arguments),
        }
        if tool.namespace is not None:
            custom["namespace"] = tool.namespace
        return custom
    function: FunctionCallItem = {
        "id": item_id,
        "type": "function_call",
        "call_id": call.id,
        "name": tool.name,
        "arguments": call.arguments,
        "status": status,
    }
    if tool.namespace is not None:
        function["namespace"] = tool.namespace
    return function


def call_prefix(req: ResponsesRequest, call: Call) -> str:
    tool = req.tools.named(call.name)
    return "ctc_" if tool is not None and tool.kind == "custom" else "fc_"


def response_shell(
    req: ResponsesRequest, *, response_id: str, created_at: int, model: str, status: str
) -> ResponseObject:
    """A Response with the request's settings echoed, no output and no usage yet."""
    text: ResponseText = {"format": req.text_format}
    if req.verbosity:
        text["verbosity"] = req.verbosity
    shell: ResponseObject = {
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
        "text": text,
        "tool_choice": req.tool_choice,
        "tools": [t.copy() for t in req.tools.echo],
        "top_p": req.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": req.user,
        "metadata": dict(req.metadata),
    }
    if req.tools.omitted:
        shell["slotkeeper"] = {"omitted_tools": [o.report() for o in req.tools.omitted]}
    return shell


# The answer's header naming the hosted tools left out of the prompt (their types, comma-separated).
OMITTED_HEADER = "X-Slotkeeper-Omitted-Tools"


def omitted_header(req: ResponsesRequest) -> dict[str, str]:
    """`OMITTED_HEADER` when hosted tools were left out (none otherwise)."""
    types = ", ".join(dict.fromkeys(o.type for o in req.tools.omitted))
    return {OMITTED_HEADER: types} if types else {}


def with_report(response: ResponseObject, report: Mapping[str, Any] | None) -> None:
    """`response`'s `slotkeeper` with the engine's report of how it served the prompt added."""
    if report is not None:
        response["slotkeeper"] = {**response.get("slotkeeper", {}), **report}


def finalize(response: ResponseObject, output: list[OutputItem], finish_reason: str | None, u: Usage) -> None:
    """Make `response` final: its output, completed or incomplete (the token limit), its usage."""
    incomplete = is_incomplete(finish_reason)
    response["status"] = "incomplete" if incomplete else "completed"
    response["incomplete_details"] = {"reason": "max_output_tokens"} if incomplete else None
    response["output"] = output
    response["usage"] = usage_object(u)


def mark_failed(response: ResponseObject, output: list[OutputItem], err: ApiError) -> None:
    """Make `response` a failed one: ResponseError's `code` is one of a fixed set."""
    response["status"] = "failed"
    response["output"] = output
    response["error"] = {
        "code": "rate_limit_exceeded" if err.status == 429 else "server_error",
        "message": err.message,
    }


def output_items(
    req: ResponsesRequest, result: ChatResult, *, parallel_tool_calls: bool, seal: Seal = None
) -> list[OutputItem]:
    # The token limit cuts the last item only (a stream closes each item as the next one starts).
    status = "incomplete" if is_incomplete(result.finish_reason) else "completed"
    out: list[OutputItem] = []
    if result.reasoning:
        cut = status if not (result.content or result.calls) else "completed"
        sealed = seal(result.reasoning) if seal is not None else None
        out.append(reasoning_item(new_id("rs_"), result.reasoning, cut, sealed))
    if result.content:
        out.append(message_item(new_id("msg_"), result.content, status))
    calls = result.calls if parallel_tool_calls else result.calls[:1]
    out.extend(call_item(req, new_id(call_prefix(req, c)), c, "completed") for c in calls)
    return out


def response_object(
    req: ResponsesRequest, chat: Mapping[str, Any], *, response_id: str, created_at: int, seal: Seal = None
) -> ResponseObject:
    """The complete Response for a `chat.completion` object (`seal`: how reasoning is sealed for
    `encrypted_content`, used when the request includes it), which the gateway answers and stores."""
    result = read_completion(chat)
    model = chat.get("model")
    response = response_shell(
        req,
        response_id=response_id,
        created_at=created_at,
        model=model if isinstance(model, str) else "",
        status="in_progress",
    )
    output = output_items(req, result, parallel_tool_calls=req.parallel_tool_calls, seal=sealer(req, seal))
    finalize(response, output, result.finish_reason, result.usage)
    if isinstance(chat.get("slotkeeper"), dict):  # how the prompt's state was served (beside usage)
        with_report(response, chat["slotkeeper"])
    return response

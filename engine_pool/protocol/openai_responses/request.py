"""A Responses API request (`POST /v1/responses`), validated and normalized. Pure.

`parse_request` checks every field this server acts on and refuses, with a 400 that names the field
(`param`), what the server cannot do: non-text content (images, files, audio), item references,
`conversation`, `background`, `truncation: "auto"` (this server never drops input items),
`max_tool_calls`, logprobs. Tools are read by `tools` (function, custom and namespace tools; hosted
ones omitted or refused by the `hosted` policy). Input items are normalized to Responses' own item
shapes with ids (a string input is one user message; an id the client sent is kept, and never
reaches the prompt), so that listing them (`input_item_list`) and translating them
(`input_messages`) read one form.

`client_metadata` (what an agent says of itself: Codex sends its session, thread and turn ids) is
kept as strings, bounded: `CLIENT_METADATA_PAIRS` keys of at most `CLIENT_METADATA_KEY_CHARS`,
values of at most `CLIENT_METADATA_VALUE_CHARS` (Codex's turn metadata is a JSON text of ~1 KB).
A reasoning item's `encrypted_content` is at most `MAX_ENCRYPTED_CHARS` long; opening it is the
gateway's (gateway.sealing).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from engine_pool.errors import BadRequest
from engine_pool.http.body import Body, json_type

from ..bounds import array_form, check_count
from ..engine_options import engine_options
from .objects import (
    CallOutputItem,
    CustomToolCallItem,
    FunctionCallItem,
    InputItem,
    InputText,
    MessageItem,
    OutputText,
    ReasoningConfig,
    ReasoningItem,
    ReasoningText,
    ResponseFormat,
    SummaryText,
    ToolChoice,
)
from .tools import Tools, check_grammars_with_format, parse_tool_choice, parse_tools

ROLES = ("user", "system", "developer", "assistant")
# Content part type -> the field holding its text.
TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
MEDIA_PARTS = ("input_image", "input_file", "input_audio")
ITEM_ID_PREFIX = {
    "message": "msg_",
    "function_call": "fc_",
    "function_call_output": "fco_",
    "custom_tool_call": "ctc_",
    "custom_tool_call_output": "ctco_",
    "reasoning": "rs_",
}
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
REASONING_SUMMARIES = ("auto", "concise", "detailed")
VERBOSITIES = ("low", "medium", "high")
# `include` values that need nothing from this server: reasoning travels as plain text in the
# reasoning items' `content`, so there is nothing to encrypt and the text round-trips as it is.
INCLUDES = ("reasoning.encrypted_content",)
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
CLIENT_METADATA_PAIRS, CLIENT_METADATA_KEY_CHARS, CLIENT_METADATA_VALUE_CHARS = 32, 128, 4096
MAX_ENCRYPTED_CHARS = 4 << 20
MAX_NAMESPACE_CHARS = 128

# Fields of the API this server does not implement, refused rather than silently ignored.
UNSUPPORTED = {
    "conversation": "'conversation' is not supported by this server; chain responses with "
    "'previous_response_id'",
    "prompt": "'prompt' (reusable prompt templates) is not supported by this server",
    "max_tool_calls": "'max_tool_calls' is not supported by this server",
}


def _text_format() -> ResponseFormat:
    return {"type": "text"}


@dataclass(frozen=True)
class ResponsesRequest:
    model: str
    items: tuple[InputItem, ...]  # the input as Responses items, ids included
    instructions: str | None = None
    tools: Tools = field(default_factory=Tools)  # offered, echoed, omitted (openai_responses.tools)
    # auto | none | required | {"type": "function" | "custom", "name": its model name}
    tool_choice: ToolChoice = "auto"
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    parallel_tool_calls: bool = True
    text_format: ResponseFormat = field(default_factory=_text_format)
    verbosity: str | None = None
    reasoning: ReasoningConfig | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    include: tuple[str, ...] = ()
    engine_options: Mapping[str, object] = field(default_factory=dict)  # llama-server extras, passed on
    client_metadata: dict[str, str] = field(default_factory=dict)


# Opens a reasoning item's `encrypted_content` (the sealed text, the item's field for errors) into
# its text, or raises BadRequest naming the field.
Open = Callable[[str, str], str]


def with_reasoning_opened(req: ResponsesRequest, open_sealed: Open) -> ResponsesRequest:
    """`req` with each reasoning item that carries `encrypted_content` rendered from its opened
    text (what the sealed turn generated, whatever `content` the client sent beside it)."""
    items: list[InputItem] = []
    for i, item in enumerate(req.items):
        if item["type"] == "reasoning" and "encrypted_content" in item:
            text = open_sealed(item["encrypted_content"], f"input[{i}].encrypted_content")
            opened = item.copy()
            opened["content"] = [{"type": "reasoning_text", "text": text}]
            item = opened
        items.append(item)
    return replace(req, items=tuple(items))


def new_item_id(kind: str) -> str:
    return ITEM_ID_PREFIX.get(kind, "item_") + secrets.token_hex(12)


def parse_request(data: dict[str, Any], *, max_items: int, hosted: str = "omit") -> ResponsesRequest:
    """The request in `data`, or BadRequest naming the first malformed field. `max_items` bounds the
    input items (and the content parts of each, and the tools); `hosted` says what becomes of
    hosted tools ("omit" | "refuse", openai_responses.tools)."""
    body = Body(data)
    for name, message in UNSUPPORTED.items():
        if body.has(name):
            raise BadRequest(message, param=name)
    if body.get_bool("background", False):
        raise BadRequest("'background' responses are not supported by this server", param="background")
    if body.get_int("top_logprobs", 0, lo=0) > 0:
        raise BadRequest("'top_logprobs' is not supported by this server", param="top_logprobs")
    if body.get_choice("truncation", "disabled", ("disabled", "auto")) == "auto":
        raise BadRequest(
            "'truncation' 'auto' is not supported: this server never drops input items to fit the context; "
            "send 'disabled' (a conversation too long for the context is refused with a 400)",
            param="truncation",
        )
    # Optional, as llama-server takes it: an engine serves one model (the gateway, which picks one by
    # name, requires it).
    model = body.get_str("model") or ""
    tools = parse_tools(body, hosted, max_items)
    tool_choice = parse_tool_choice(body, tools)
    text_format = _format(body)
    check_grammars_with_format(tools, tool_choice, text_format["type"])
    return ResponsesRequest(
        model=model,
        items=_input(body, max_items),
        instructions=body.get_str("instructions"),
        tools=tools,
        tool_choice=tool_choice,
        max_output_tokens=_optional_int(body, "max_output_tokens", lo=1),
        temperature=_optional_float(body, "temperature", 0.0, 2.0),
        top_p=_optional_float(body, "top_p", 0.0, 1.0),
        stream=body.get_bool("stream", False),
        store=body.get_bool("store", True),
        previous_response_id=_optional_id(body, "previous_response_id"),
        metadata=_metadata(body),
        parallel_tool_calls=body.get_bool("parallel_tool_calls", True),
        text_format=text_format,
        verbosity=_verbosity(body),
        reasoning=_reasoning(body),
        user=body.get_str("user"),
        prompt_cache_key=body.get_str("prompt_cache_key"),
        safety_identifier=body.get_str("safety_identifier"),
        include=_include(body),
        engine_options=engine_options(data, "responses"),
        client_metadata=_client_metadata(body),
    )


# -- scalar fields ------------------------------------------------------------------------------
def _optional_int(body: Body, name: str, *, lo: int) -> int | None:
    return body.get_int(name, 0, lo=lo) if body.has(name) else None


def _optional_float(body: Body, name: str, lo: float, hi: float) -> float | None:
    return body.get_float(name, 0.0, lo=lo, hi=hi) if body.has(name) else None


def _optional_id(body: Body, name: str) -> str | None:
    value = body.get_str(name)
    if value is not None and not value:
        raise BadRequest(f"'{name}' must not be empty", param=name)
    return value


def _metadata(body: Body) -> dict[str, str]:
    return _string_pairs(body, "metadata", METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS)


def _client_metadata(body: Body) -> dict[str, str]:
    return _string_pairs(
        body, "client_metadata", CLIENT_METADATA_PAIRS, CLIENT_METADATA_KEY_CHARS, CLIENT_METADATA_VALUE_CHARS
    )


def _string_pairs(body: Body, name: str, pairs: int, key_chars: int, value_chars: int) -> dict[str, str]:
    """An object of string values, bounded in pairs, key and value lengths, each refused precisely."""
    meta = body.get_object(name)
    if meta is None:
        return {}
    if len(meta.data) > pairs:
        raise BadRequest(
            f"'{name}' has {len(meta.data)} pairs; at most {pairs} are allowed",
            param=name,
            extra={"limit": pairs},
        )
    for key, value in meta.data.items():
        if len(key) > key_chars:
            raise BadRequest(
                f"'{name}' keys have at most {key_chars} characters; {key[:20]!r}... has {len(key)}",
                param=name,
                extra={"limit": key_chars},
            )
        if not isinstance(value, str) or len(value) > value_chars:
            raise BadRequest(
                f"'{name}.{key}' must be a string of at most {value_chars} characters",
                param=f"{name}.{key}",
                extra={"limit": value_chars},
            )
    return dict(meta.data)


def _include(body: Body) -> tuple[str, ...]:
    values = body.get_list("include") or []
    for i, value in enumerate(values):
        if value not in INCLUDES:
            raise BadRequest(
                f"'include[{i}]': {value!r} is not supported by this server "
                f"(supported: {', '.join(INCLUDES)})",
                param=f"include[{i}]",
            )
    return tuple(values)


def _reasoning(body: Body) -> ReasoningConfig | None:
    reasoning = body.get_object("reasoning")
    if reasoning is None:
        return None
    out: ReasoningConfig = {"effort": None, "summary": None}
    if reasoning.has("effort"):
        out["effort"] = reasoning.get_choice("effort", "medium", REASONING_EFFORTS)
    for name in ("summary", "generate_summary"):
        if reasoning.has(name):
            out["summary"] = reasoning.get_choice(name, "auto", REASONING_SUMMARIES)
    return out


def _text(body: Body) -> Body | None:
    return body.get_object("text")


def _verbosity(body: Body) -> str | None:
    text = _text(body)
    return text.get_choice("verbosity", "medium", VERBOSITIES) if text and text.has("verbosity") else None


def _format(body: Body) -> ResponseFormat:
    """`text.format`: text, json_object or json_schema {name, schema, strict, description}."""
    text = _text(body)
    fmt = text.get_object("format") if text else None
    if fmt is None:
        return _text_format()
    kind = fmt.get_choice("type", "text", ("text", "json_object", "json_schema"))
    if kind != "json_schema":
        return {"type": kind}
    name = fmt.get_str("name")
    if not name:
        raise BadRequest("'text.format.name' is required for a json_schema format", param="text.format.name")
    schema = fmt.raw("schema")
    if not isinstance(schema, dict):
        raise BadRequest(
            f"'text.format.schema' must be a JSON schema object, got {json_type(schema)}",
            param="text.format.schema",
        )
    out: ResponseFormat = {"type": "json_schema", "name": name, "schema": schema}
    if fmt.has("strict"):
        out["strict"] = fmt.get_bool("strict", False)
    description = fmt.get_str("description")
    if description is not None:
        out["description"] = description
    return out


# -- input items --------------------------------------------------------------------------------
def _input(body: Body, max_items: int) -> tuple[InputItem, ...]:
    raw = body.raw("input")
    if raw is None:
        raise BadRequest("'input' is required", param="input")
    if isinstance(raw, str):
        return (
            {"type": "message", "role": "user", "content": [_input_text(raw)], "id": new_item_id("message")},
        )
    items = array_form(raw, "input", max_items, "items")
    if not items:
        raise BadRequest("'input' must not be an empty array", param="input")
    return tuple(_item(item, f"input[{i}]", max_items) for i, item in enumerate(items))


def _item(raw: Any, where: str, max_parts: int) -> InputItem:
    if not isinstance(raw, dict):
        raise BadRequest(f"'{where}' must be an object, got {json_type(raw)}", param=where)
    kind = raw.get("type") or ("message" if "role" in raw else None)
    if kind == "item_reference":
        raise BadRequest(
            f"'{where}': item_reference is not supported by this server; send the item itself, "
            "or chain with 'previous_response_id'",
            param=where,
        )
    if not isinstance(kind, str) or kind not in _ITEMS:
        raise BadRequest(
            f"'{where}': input item type {kind!r} is not supported by this server "
            f"(supported: {', '.join(_ITEMS)})",
            param=where,
        )
    item = Body(raw, where)
    return _ITEMS[kind](item, item.get_str("id") or new_item_id(kind), max_parts)


def _required_str(item: Body, name: str) -> str:
    value = item.get_str(name)
    if not value:
        raise BadRequest(f"'{item.name(name)}' must be a non-empty string", param=item.name(name))
    return value


def _message(item: Body, item_id: str, max_parts: int) -> MessageItem:
    role = item.get_str("role")
    if role is None or role not in ROLES:
        raise BadRequest(
            f"'{item.name('role')}' must be one of {', '.join(ROLES)}; got {role!r}", param=item.name("role")
        )
    content = item.raw("content")
    texts = [content] if isinstance(content, str) else _text_parts(item, "content", max_parts)
    part = _output_text if role == "assistant" else _input_text
    return {"type": "message", "role": role, "content": [part(t) for t in texts], "id": item_id}


def _input_text(text: str) -> InputText:
    return {"type": "input_text", "text": text}


def _output_text(text: str) -> OutputText:
    return {"type": "output_text", "text": text, "annotations": []}


def _text_parts(item: Body, field: str, max_parts: int) -> list[str]:
    """The texts of the item's array of content parts `field`; media parts are refused, naming the part."""
    array_form(item.raw(field), item.name(field), max_parts, "content parts")
    texts = []
    for entry in item.objects(field):
        part, at = entry.data, entry.path
        kind = part.get("type")
        if kind in MEDIA_PARTS:
            raise BadRequest(
                f"'{at}': content part type {kind!r} is not supported by this server (text only)", param=at
            )
        text_field = TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if text_field is None:
            raise BadRequest(f"'{at}': unknown content part type {kind!r}", param=at)
        text = part.get(text_field)
        if not isinstance(text, str):
            raise BadRequest(f"'{at}.{text_field}' must be a string, got {json_type(text)}", param=at)
        texts.append(text)
    return texts


def _namespace(item: Body) -> str | None:
    """An item's `namespace` (a namespaced tool's call), when it has one."""
    if not item.has("namespace"):
        return None
    value = item.get_str("namespace")
    where = item.name("namespace")
    if not value or len(value) > MAX_NAMESPACE_CHARS:
        raise BadRequest(
            f"'{where}' must be a non-empty string of at most {MAX_NAMESPACE_CHARS} characters", param=where
        )
    return value


def _function_call(item: Body, item_id: str, max_parts: int) -> FunctionCallItem:
    arguments = item.get_str("arguments")
    if arguments is None:
        raise BadRequest(f"'{item.name('arguments')}' must be a JSON string", param=item.name("arguments"))
    call_id, namespace = _required_str(item, "call_id"), _namespace(item)
    out: FunctionCallItem = {
        "type": "function_call",
        "call_id": call_id,
        "name": _required_str(item, "name"),
        "arguments": arguments,
        "id": item_id,
    }
    if namespace is not None:
        out["namespace"] = namespace
    return out


def _custom_tool_call(item: Body, item_id: str, max_parts: int) -> CustomToolCallItem:
    text = item.get_str("input")
    if text is None:
        raise BadRequest(f"'{item.name('input')}' must be a string", param=item.name("input"))
    call_id, namespace = _required_str(item, "call_id"), _namespace(item)
    out: CustomToolCallItem = {
        "type": "custom_tool_call",
        "call_id": call_id,
        "name": _required_str(item, "name"),
        "input": text,
        "id": item_id,
    }
    if namespace is not None:
        out["namespace"] = namespace
    return out


def _call_output(item: Body, item_id: str, max_parts: int) -> CallOutputItem:
    """A function's or a custom tool's output (a string, or content parts whose texts are joined)."""
    output = item.raw("output")
    if output is None:
        raise BadRequest(f"'{item.name('output')}' is required", param=item.name("output"))
    text = output if isinstance(output, str) else "\n".join(_text_parts(item, "output", max_parts))
    custom = item.data["type"] == "custom_tool_call_output"
    return {
        "type": "custom_tool_call_output" if custom else "function_call_output",
        "call_id": _required_str(item, "call_id"),
        "output": text,
        "id": item_id,
    }


def _reasoning_texts(item: Body, name: str, part_type: str, max_parts: int) -> list[str] | None:
    """The texts of a reasoning item's `summary` or `content` parts (all of `part_type`)."""
    parts = item.get_list(name)
    if parts is None:
        return None
    check_count(item.name(name), parts, max_parts, "parts")
    for j, part in enumerate(parts):
        at = f"{item.name(name)}[{j}]"
        if (
            not isinstance(part, dict)
            or part.get("type") != part_type
            or not isinstance(part.get("text"), str)
        ):
            raise BadRequest(f'\'{at}\' must be {{"type": "{part_type}", "text": ...}}', param=at)
    return [p["text"] for p in parts]


def _reasoning_item(item: Body, item_id: str, max_parts: int) -> ReasoningItem:
    summary = _reasoning_texts(item, "summary", "summary_text", max_parts) or []
    content = _reasoning_texts(item, "content", "reasoning_text", max_parts)
    out: ReasoningItem = {"type": "reasoning", "summary": [_summary_text(t) for t in summary], "id": item_id}
    if content is not None:
        out["content"] = [_reasoning_text(t) for t in content]
    if item.has("encrypted_content"):
        sealed = item.get_str("encrypted_content")
        assert sealed is not None
        if len(sealed) > MAX_ENCRYPTED_CHARS:
            raise BadRequest(
                f"'{item.name('encrypted_content')}' has {len(sealed)} characters; at most "
                f"{MAX_ENCRYPTED_CHARS} are accepted",
                param=item.name("encrypted_content"),
                extra={"limit": MAX_ENCRYPTED_CHARS},
            )
        out["encrypted_content"] = sealed
    return out


def _summary_text(text: str) -> SummaryText:
    return {"type": "summary_text", "text": text}


def _reasoning_text(text: str) -> ReasoningText:
    return {"type": "reasoning_text", "text": text}


_ITEMS: dict[str, Callable[[Body, str, int], InputItem]] = {
    "message": _message,
    "function_call": _function_call,
    "function_call_output": _call_output,
    "custom_tool_call": _custom_tool_call,
    "custom_tool_call_output": _call_output,
    "reasoning": _reasoning_item,
}

"""The Responses API objects this package builds, as types. Pure.

TypedDicts, as in `engine_answers`: objects we build and send as JSON unchanged. Key names and
optionality follow OpenAI's published spec (`ReasoningItem`, `FunctionToolCall`, `CustomToolCall`,
`OutputMessage`, `FunctionCallOutputItemParam`, `FunctionTool`, `CustomToolParam`, `Response`, ...).
An input item is normalized (`request`) to the same shape as the output item of its type, with an
id; a listing (`input_item_list`) adds `status`. What a client sends is read through
`engine_pool.http.body.Body`, never taken for one of these; a stored response read back is JSON
(`Mapping[str, Any]`) too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NotRequired, TypedDict


# -- content parts ------------------------------------------------------------------------------
class InputText(TypedDict):
    type: Literal["input_text"]
    text: str


class OutputText(TypedDict):
    type: Literal["output_text"]
    text: str
    annotations: list[object]  # none are written
    logprobs: NotRequired[list[object]]  # an output's: none are written


class SummaryText(TypedDict):
    type: Literal["summary_text"]
    text: str


class ReasoningText(TypedDict):
    type: Literal["reasoning_text"]
    text: str


# -- items --------------------------------------------------------------------------------------
class MessageItem(TypedDict):
    """A message: input (any role; `input_text` parts, `output_text` for an assistant's) or output."""

    id: str
    type: Literal["message"]
    role: str  # user | system | developer | assistant
    content: list[InputText | OutputText]
    status: NotRequired[str]


class FunctionCallItem(TypedDict):
    id: str
    type: Literal["function_call"]
    call_id: str
    namespace: NotRequired[str]  # a namespaced tool's
    name: str
    arguments: str  # a JSON text
    status: NotRequired[str]


class CustomToolCallItem(TypedDict):
    id: str
    type: Literal["custom_tool_call"]
    call_id: str
    namespace: NotRequired[str]
    name: str
    input: str
    status: NotRequired[str]  # a listing's only (the spec's CustomToolCall has none)


class CallOutputItem(TypedDict):
    """A `function_call_output` or `custom_tool_call_output` (its output's text)."""

    id: str
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str
    output: str
    status: NotRequired[str]


class ReasoningItem(TypedDict):
    id: str
    type: Literal["reasoning"]
    summary: list[SummaryText]
    content: NotRequired[list[ReasoningText]]
    encrypted_content: NotRequired[str]
    status: NotRequired[str]


OutputItem = MessageItem | FunctionCallItem | CustomToolCallItem | ReasoningItem
InputItem = OutputItem | CallOutputItem


# -- tools --------------------------------------------------------------------------------------
class CustomTextFormat(TypedDict):
    type: Literal["text"]


class CustomGrammarFormat(TypedDict):
    type: Literal["grammar"]
    syntax: str  # lark | regex
    definition: str


CustomFormat = CustomTextFormat | CustomGrammarFormat  # a custom tool's `format`


class FunctionToolEcho(TypedDict):
    """A function tool as a response's `tools` shows it (`FunctionTool`)."""

    type: Literal["function"]
    name: str
    description: str | None
    parameters: dict[str, Any] | None  # the client's JSON schema
    strict: bool | None


class CustomToolEcho(TypedDict):
    type: Literal["custom"]
    name: str
    format: CustomFormat
    description: NotRequired[str]


class NamespaceEcho(TypedDict):
    type: Literal["namespace"]
    name: str | None
    description: str | None
    tools: list[FunctionToolEcho | CustomToolEcho]


ToolEcho = FunctionToolEcho | CustomToolEcho | NamespaceEcho


class NamedToolChoice(TypedDict):
    """`tool_choice` naming one tool (`ToolChoiceFunction`, `ToolChoiceCustom`): by its model name."""

    type: str  # function | custom
    name: str


ToolChoice = str | NamedToolChoice  # auto | none | required, or one tool


# -- request settings echoed --------------------------------------------------------------------
class ResponseFormat(TypedDict):
    """`text.format`: text, json_object, or json_schema with its name and schema."""

    type: str  # text | json_object | json_schema
    name: NotRequired[str]
    schema: NotRequired[dict[str, Any]]  # the client's JSON schema
    strict: NotRequired[bool]
    description: NotRequired[str]


class ReasoningConfig(TypedDict):
    effort: str | None
    summary: str | None


class ResponseText(TypedDict):
    format: ResponseFormat
    verbosity: NotRequired[str]


# -- the response -------------------------------------------------------------------------------
class InputTokensDetails(TypedDict):
    cached_tokens: int  # the prompt tokens the engine reused
    cache_write_tokens: int


class OutputTokensDetails(TypedDict):
    reasoning_tokens: int


class ResponseUsage(TypedDict):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(TypedDict):
    code: str  # server_error | rate_limit_exceeded (of the spec's fixed set)
    message: str


class IncompleteDetails(TypedDict):
    reason: str


class ResponseObject(TypedDict):
    """A Response (`object: "response"`) with the request's settings echoed; `slotkeeper` (beyond
    the spec) holds the hosted tools left out and the engine's reuse report, as it came."""

    id: str
    object: Literal["response"]
    created_at: int
    status: str  # in_progress | completed | incomplete | failed
    background: bool
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    prompt_cache_key: str | None
    reasoning: ReasoningConfig
    safety_identifier: str | None
    store: bool
    temperature: float | None
    text: ResponseText
    tool_choice: ToolChoice
    tools: list[ToolEcho]
    top_p: float | None
    truncation: str
    usage: ResponseUsage | None
    user: str | None
    metadata: dict[str, str]
    slotkeeper: NotRequired[Mapping[str, Any]]

"""The chat completions request the Responses and Messages translations build, as types. Pure.

TypedDicts, as in `engine_answers`: these are objects we build and send as JSON unchanged, so the
type costs nothing at run time and names the keys once. Key names and optionality follow OpenAI's
published `CreateChatCompletionRequest` (a key the spec makes optional is `NotRequired`, or the
TypedDict is `total=False`), with llama-server's additions: a message's `reasoning_content`, a
tool's `input_grammar` (a custom tool's grammar, which the engine enforces on its calls), `top_k`.

The engine reads a client's chat messages and tools as these same types once
`engine_pool.server.chat_request` has checked them, so a few fields are wider than a translation
writes them: content as text parts (`ChatTextPart`), a past call's arguments as the JSON object
itself and its `id`/`type` left out (llama-server takes both), `reasoning_content` null, a tool
without `type`, a function's `parameters` null.

Two things in a chat body are JSON that no type here checks: a JSON schema a client sent (a tool's
`parameters`, `response_format.json_schema.schema`), and llama-server's options a request passes
through unread (`engine_options`), which `chat_request` adds to the typed body. The chat path reads
the result as any chat body, through `engine_pool.http.body.Body`: `chat_request` is where a typed
body becomes that JSON object.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, NotRequired, Required, TypedDict


class ChatFunctionCall(TypedDict):
    name: str
    # A JSON text; a client may send the object itself (llama-server's), which the template writes.
    arguments: NotRequired[str | dict[str, Any]]


class ChatToolCall(TypedDict):
    """An assistant message's `tool_calls[]` (`ChatCompletionMessageToolCall`)."""

    id: NotRequired[str]  # (a translation always writes it; a client may leave it out)
    type: NotRequired[Literal["function"]]  # (likewise)
    function: ChatFunctionCall


class ChatTextPart(TypedDict):
    """A content part of a client's message: the engine takes text parts only."""

    type: Literal["text"]
    text: str


class ChatMessage(TypedDict):
    """One message of `messages`: system, user, assistant or tool (one shape for the four roles the
    translations write, as llama-server reads them; the engine reads a client's in it too)."""

    role: str
    # None: an assistant turn of tool calls (or reasoning) only; parts: a client's (never written here)
    content: str | list[ChatTextPart] | None
    reasoning_content: NotRequired[str | None]  # assistant (llama-server's; a client may send null)
    tool_calls: NotRequired[list[ChatToolCall]]  # assistant
    tool_call_id: NotRequired[str]  # tool
    name: NotRequired[str]  # the sender's name (a tool message's function, in some templates)


class ChatFunction(TypedDict):
    """A function tool's `function` (`FunctionObject`)."""

    name: str
    description: NotRequired[str]
    parameters: NotRequired[dict[str, Any] | None]  # the client's JSON schema (a client may send null)
    strict: NotRequired[bool]


class InputGrammar(TypedDict):
    """A custom tool's grammar (llama-server has none: Slotkeeper's engine reads it)."""

    syntax: str  # lark | regex
    definition: str


class ChatTool(TypedDict):
    type: NotRequired[Literal["function"]]  # (a translation always writes it; a client may leave it out)
    function: ChatFunction
    input_grammar: NotRequired[InputGrammar]


class ChatFunctionName(TypedDict):
    name: str


class ChatNamedToolChoice(TypedDict):
    type: Literal["function"]
    function: ChatFunctionName


ChatToolChoice = str | ChatNamedToolChoice  # none | auto | required, or one function


class ChatJsonSchema(TypedDict):
    name: str
    schema: dict[str, Any]  # the client's JSON schema
    strict: NotRequired[bool]
    description: NotRequired[str]


class ChatResponseFormat(TypedDict):
    type: str  # json_object | json_schema
    json_schema: NotRequired[ChatJsonSchema]


class StreamOptions(TypedDict):
    include_usage: bool


class ChatBody(TypedDict, total=False):
    """A chat completions request as a translation writes it (before `chat_request` adds the
    engine options it passes through)."""

    model: Required[str]
    # ChatMessages; a stored conversation a Responses request continues is among them as storage
    # read it back (JSON: a type would be no check), hence Mapping.
    messages: Required[Sequence[Mapping[str, Any]]]
    max_tokens: int
    tools: list[ChatTool]
    tool_choice: ChatToolChoice
    parallel_tool_calls: bool
    stop: list[str]
    temperature: float
    top_p: float
    top_k: int
    response_format: ChatResponseFormat
    stream: bool
    stream_options: StreamOptions


def chat_request(body: ChatBody, engine_options: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON object the chat path reads: `body` and llama-server's options passed through
    unread (`engine_options`, whose names the translation defines no field for, so neither
    overrides the other)."""
    return {**body, **engine_options}

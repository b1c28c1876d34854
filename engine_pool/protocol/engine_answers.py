"""What an engine answers, as types: OpenAI's chat and text completions (objects and stream chunks)
with llama-server's additions, and llama-server's `/completion` result.

TypedDicts: the engine builds these objects and sends them as JSON unchanged, so the type costs
nothing at run time and says, once for every module that builds or reads one, which keys there are.
Readers of another engine's JSON (the gateway's relays, `chat_result`) still take what arrives as
`Mapping[str, Any]`: a type is no check. Keys beyond OpenAI's: `timings` (llama-server's, numbers
only), `slotkeeper` (`report.ReuseReport`), `id_slot`, `reasoning_content`, a choice's
`stopping_word`, and `__verbose` (llama-server's debug copy of the `/completion` result).
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

from .report import ReuseReport


class Timings(TypedDict):
    """llama-server's `timings`: prompt and generation counts, times and rates."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


class PromptProgress(TypedDict):
    """llama-server's `prompt_progress` (a stream's `return_progress`): the prompt's tokens, those
    reused from the cache, those in the slot so far (reused + evaluated), milliseconds since start."""

    total: int
    cache: int
    processed: int
    time_ms: int


class Extras(TypedDict):
    """What llama-server (and Slotkeeper) add to an answer per decode run."""

    timings: Timings
    slotkeeper: ReuseReport
    id_slot: int


class Head(TypedDict):
    """What every object and chunk of one request repeats."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str


class PromptTokensDetails(TypedDict):
    cached_tokens: int  # the prompt tokens reused instead of computed (timings.cache_n)


class CompletionTokensDetails(TypedDict):
    reasoning_tokens: int


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


# -- log-probabilities --------------------------------------------------------------------------------
class TokenPiece(TypedDict):
    id: int
    token: str  # the piece's complete characters
    bytes: list[int]  # all its bytes (a piece may end inside a character)


class TopLogprob(TokenPiece):
    logprob: float


class TokenLogprob(TopLogprob):
    """One generated token of llama-server's `completion_probabilities` (and chat's
    `logprobs.content`, a superset of OpenAI's entries)."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(TypedDict):
    content: list[TokenLogprob]
    refusal: None


class CompletionLogprobs(TypedDict):
    """OpenAI's legacy completions `logprobs`, plus llama-server's `content` entries."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]  # per token: text -> logprob
    text_offset: list[int]
    content: list[TokenLogprob]


# -- llama-server's /completion -----------------------------------------------------------------------
class LlamaCompletion(TypedDict):
    """llama-server's `/completion` result (streamed: the last chunk, without text and tokens)."""

    index: int
    content: str
    tokens: list[int]
    id_slot: int
    stop: bool
    model: str
    tokens_predicted: int
    tokens_evaluated: int
    generation_settings: dict[str, Any]  # the sampling settings in llama-server's names (sampling.py)
    prompt: str
    has_new_line: bool
    truncated: bool
    stop_type: str
    stopping_word: str
    tokens_cached: int
    timings: Timings
    slotkeeper: ReuseReport
    completion_probabilities: NotRequired[list[TokenLogprob]]


class LlamaChunk(TypedDict):
    """A streamed `/completion` chunk before the last."""

    index: int
    content: str
    tokens: list[int]
    stop: bool
    completion_probabilities: NotRequired[list[TokenLogprob]]
    timings: NotRequired[Timings]  # with `timings_per_token`
    prompt_progress: NotRequired[PromptProgress]  # with `return_progress`


# -- chat completions ---------------------------------------------------------------------------------
class FunctionCall(TypedDict):
    name: str
    arguments: str  # a JSON text


class MessageToolCall(TypedDict):
    id: str
    type: str  # "function"
    function: FunctionCall


class AssistantMessage(TypedDict):
    role: str
    content: str | None
    reasoning_content: NotRequired[str]
    tool_calls: NotRequired[list[MessageToolCall]]


class ChatChoice(TypedDict):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str
    stopping_word: NotRequired[str]
    timings: NotRequired[Timings]  # with `n` > 1 each choice carries its decode run's extras
    slotkeeper: NotRequired[ReuseReport]
    id_slot: NotRequired[int]


ChatCompletion = TypedDict(
    "ChatCompletion",
    {
        "id": str,
        "object": str,
        "created": int,
        "model": str,
        "system_fingerprint": str,
        "choices": list[ChatChoice],
        "usage": Usage,
        "timings": NotRequired[Timings],  # with one choice, its decode run's extras
        "slotkeeper": NotRequired[ReuseReport],
        "id_slot": NotRequired[int],
        "__verbose": NotRequired[LlamaCompletion],
    },
)


class FunctionDelta(TypedDict, total=False):
    name: str
    arguments: str


class ToolCallDelta(TypedDict):
    index: int
    id: NotRequired[str]
    type: NotRequired[str]
    function: FunctionDelta


class ChunkDelta(TypedDict, total=False):
    role: str
    content: str | None
    reasoning_content: str
    tool_calls: list[ToolCallDelta]


class ChunkChoice(TypedDict):
    index: int
    delta: ChunkDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stopping_word: NotRequired[str]


ChatChunk = TypedDict(
    "ChatChunk",
    {
        "id": str,
        "object": str,
        "created": int,
        "model": str,
        "system_fingerprint": str,
        "choices": list[ChunkChoice],
        "usage": NotRequired[Usage | None],  # None on every chunk but the last, with include_usage
        "timings": NotRequired[Timings],  # the finishing chunk's and the usage chunk's
        "slotkeeper": NotRequired[ReuseReport],  # the first chunk's: only `prompt_tokens`
        "prompt_progress": NotRequired[PromptProgress],  # with `return_progress`
        "id_slot": NotRequired[int],
        "__verbose": NotRequired[LlamaCompletion],
    },
)


# -- text completions ---------------------------------------------------------------------------------
class TextChoice(TypedDict):
    text: str
    index: int
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    timings: NotRequired[Timings]
    slotkeeper: NotRequired[ReuseReport]
    id_slot: NotRequired[int]


TextCompletion = TypedDict(
    "TextCompletion",
    {
        "id": str,
        "object": str,
        "created": int,
        "model": str,
        "system_fingerprint": str,
        "choices": list[TextChoice],
        "usage": NotRequired[Usage | None],
        "timings": NotRequired[Timings],
        "slotkeeper": NotRequired[ReuseReport],
        "id_slot": NotRequired[int],
        "__verbose": NotRequired[LlamaCompletion],
        "prompt_progress": NotRequired[PromptProgress],  # with `return_progress`
    },
)

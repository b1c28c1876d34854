"""What the benchmarks read of a server's answers, as types: llama-server's `timings` (ours and
upstream's alike), a chat completion's usage and first message, and the node's engine list.

The JSON arrives untyped (`object`) and is parsed here once, with the project's codec
(`engine_pool.protocol.codec`): a field a bench reads is checked where it is read, a `WireError`
(a ValueError) names the one that is missing or of the wrong type, and unknown keys are ignored.
A chat answer's message is kept as it came: an agent sends it back unchanged in its next turn.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from engine_pool.protocol.codec import Wire, WireError, decode
from engine_pool.protocol.node import EngineList, NodeEngine


@dataclass(frozen=True)
class Tokens(Wire):
    """`/tokenize`'s answer."""

    tokens: list[int]


@dataclass(frozen=True)
class InputTokens(Wire):
    """`/v1/chat/completions/input_tokens`' answer: the prompt's tokens as the engine renders it."""

    input_tokens: int


@dataclass(frozen=True)
class Timings:
    """llama-server's `timings` (`engine_answers.Timings`), the counts the benchmarks read."""

    prompt_n: int  # prompt tokens evaluated
    prompt_ms: float
    predicted_n: int
    cache_n: int | None = None  # prompt tokens reused (absent from an older llama-server)


@dataclass(frozen=True)
class PromptTokensDetails:
    cached_tokens: int | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int | None = None
    prompt_tokens_details: PromptTokensDetails | None = None


@dataclass(frozen=True)
class ChatAnswer:
    """A chat completion: `message` is its first choice's message as it came (empty when it has
    none), `usage` and `timings` None when absent."""

    message: Mapping[str, object]
    usage: Usage | None
    timings: Timings | None

    @property
    def content(self) -> str:
        return str(self.message.get("content") or "")

    @property
    def cached_tokens(self) -> int | None:
        """`usage.prompt_tokens_details.cached_tokens`; None when the answer does not say."""
        details = self.usage.prompt_tokens_details if self.usage else None
        return details.cached_tokens if details else None

    def timed(self) -> Timings:
        """Its timings, which a bench's row needs (a WireError without them)."""
        if self.timings is None:
            raise WireError("'timings' is required", "timings")
        return self.timings

    def prompt_tokens(self) -> int:
        """`usage.prompt_tokens`, which a bench's row needs (a WireError without it)."""
        if self.usage is None or self.usage.prompt_tokens is None:
            raise WireError("'usage.prompt_tokens' is required", "usage.prompt_tokens")
        return self.usage.prompt_tokens


def stream_chunks(lines: Iterable[str]) -> Iterator[Any]:
    """The JSON chunks of a chat stream's lines (`data: {...}`; the closing `[DONE]` and any other
    line skipped)."""
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def timings(data: object) -> Timings | None:
    """An answer's or a stream chunk's `timings` (None when it has none, or an empty one)."""
    found = data.get("timings") if isinstance(data, Mapping) else None
    return decode(Timings, found, "timings") if found else None


def timed(data: object) -> Timings:
    """An answer's `timings`, which the bench needs (a WireError when it has none)."""
    found = timings(data)
    if found is None:
        raise WireError("'timings' is required", "timings")
    return found


def chat_answer(data: object) -> ChatAnswer:
    """A chat completion's JSON as a `ChatAnswer`."""
    if not isinstance(data, Mapping):
        raise WireError("a chat answer must be an object", "")
    choices = data.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    message = first.get("message") if isinstance(first, Mapping) else None
    usage = data.get("usage")
    return ChatAnswer(
        message if isinstance(message, Mapping) else {},
        None if usage is None else decode(Usage, usage, "usage"),
        timings(data),
    )


def engine_list(resp: httpx.Response) -> list[NodeEngine]:
    """The engines of a node's `GET /v1/engines` answer."""
    return list(EngineList.from_json(resp.json()).engines)


def engine_url(engine: NodeEngine) -> str:
    """Where the engine listens (a RuntimeError while it has no process)."""
    if engine.url is None:
        raise RuntimeError(f"engine {engine.id} has no URL ({engine.state})")
    return engine.url

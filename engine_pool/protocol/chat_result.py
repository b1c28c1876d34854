"""What the Responses and Messages translations read from the chat path: a completion, or its chunks.

A chat completion (`run_chat`'s dict, or an engine's JSON relayed by the gateway) becomes a
`ChatResult`; a stream of chat chunks becomes `Piece`s in order (`ChunkReader.feed`): reasoning
text, content text, the start of a tool call and its argument fragments, the finish, the usage;
`ChunkStream` turns those pieces into another API's stream events (the Responses and Messages
streams say what each piece becomes).
Every key beyond the OpenAI chunk/completion shape is optional: `reasoning_content` (present when
the model reasons), `usage.prompt_tokens_details.cached_tokens`, `completion_tokens_details.
reasoning_tokens` and `choices[0].stopping_word` (the stop string that ended the generation). Pure.
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the engine reused instead of computing
    reasoning_tokens: int = 0


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: str  # a JSON text, as chat completions carry it


@dataclass(frozen=True)
class ChatResult:
    content: str
    reasoning: str
    calls: list[Call]
    finish_reason: str | None  # stop | length | tool_calls | ...
    stopping_word: str  # "" unless a stop string ended the generation
    usage: Usage


# The JSON read here is another service's answer (or run_chat's), read field by field: whatever is
# not what a field should be reads as absent.
def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _object(value: object) -> Mapping[str, object]:
    return value if isinstance(value, dict) else {}


def _str(value: object) -> str:
    return value if isinstance(value, str) else ""


def read_usage(usage: object) -> Usage:
    u = _object(usage)
    return Usage(
        prompt_tokens=_int(u.get("prompt_tokens")),
        completion_tokens=_int(u.get("completion_tokens")),
        cached_tokens=_int(_object(u.get("prompt_tokens_details")).get("cached_tokens")),
        reasoning_tokens=_int(_object(u.get("completion_tokens_details")).get("reasoning_tokens")),
    )


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _call(raw: object) -> Call:
    call = _object(raw)
    fn = _object(call.get("function"))
    args = fn.get("arguments")
    return Call(
        id=_str(call.get("id")) or new_call_id(),
        name=_str(fn.get("name")),
        arguments=args if isinstance(args, str) else "{}",
    )


def read_completion(chat: Mapping[str, object]) -> ChatResult:
    """The first choice and the usage of a `chat.completion` object."""
    choices = chat.get("choices")
    choice = _object(choices[0]) if isinstance(choices, list) and choices else {}
    message = _object(choice.get("message"))
    calls = message.get("tool_calls")
    finish = choice.get("finish_reason")
    return ChatResult(
        content=_str(message.get("content")),
        reasoning=_str(message.get("reasoning_content")),
        calls=[_call(c) for c in calls] if isinstance(calls, list) else [],
        finish_reason=finish if isinstance(finish, str) else None,
        stopping_word=_str(choice.get("stopping_word")),
        usage=read_usage(chat.get("usage")),
    )


# -- streams ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int  # the chat stream's tool call index
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    index: int
    fragment: str


@dataclass(frozen=True)
class Finish:
    reason: str
    stopping_word: str


@dataclass(frozen=True)
class UsageSeen:
    usage: Usage


Piece = Text | Reasoning | CallStart | CallArgs | Finish | UsageSeen


class ChunkReader:
    """`chat.completion.chunk` dicts in, `Piece`s out, in the order the chunks carry them.

    A tool call starts at the first delta of its index (which carries its id and name in OpenAI's
    stream); fragments of its arguments follow, in this delta or later ones.
    """

    def __init__(self) -> None:
        self.model = ""
        self.prompt_tokens = 0  # the prompt's size, from the first chunk (`slotkeeper.prompt_tokens`)
        # The engine's reuse report (`slotkeeper`), when sent, and its last `timings` (the last
        # chunk's: final), passed on as they came.
        self.report: Mapping[str, object] | None = None
        self.timings: Mapping[str, object] | None = None
        self._calls: set[int] = set()

    def feed(self, chunk: Mapping[str, object]) -> list[Piece]:
        self.model = self.model or _str(chunk.get("model"))
        timings = chunk.get("timings")
        if isinstance(timings, dict):
            self.timings = timings
        engine = _object(chunk.get("slotkeeper"))
        if "reuse" in engine:  # the last chunk's report (the first one carries the prompt's size only)
            self.report = engine
        self.prompt_tokens = self.prompt_tokens or _int(engine.get("prompt_tokens"))
        out: list[Piece] = []
        choices = chunk.get("choices")
        for raw in choices if isinstance(choices, list) else []:
            choice = _object(raw)
            if _int(choice.get("index")) != 0:
                continue
            delta = _object(choice.get("delta"))
            if reasoning := _str(delta.get("reasoning_content")):
                out.append(Reasoning(reasoning))
            if content := _str(delta.get("content")):
                out.append(Text(content))
            calls = delta.get("tool_calls")
            for call in calls if isinstance(calls, list) else []:
                out.extend(self._call(_object(call)))
            finish = choice.get("finish_reason")
            if isinstance(finish, str) and finish:
                out.append(Finish(finish, _str(choice.get("stopping_word"))))
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            out.append(UsageSeen(read_usage(usage)))
        return out

    def _call(self, call: Mapping[str, object]) -> list[Piece]:
        index = _int(call.get("index"))
        fn = _object(call.get("function"))
        out: list[Piece] = []
        if index not in self._calls:
            self._calls.add(index)
            out.append(CallStart(index, _str(call.get("id")) or new_call_id(), _str(fn.get("name"))))
        if args := _str(fn.get("arguments")):
            out.append(CallArgs(index, args))
        return out


Event = tuple[str, dict[str, Any]]  # (SSE event name, its data)
Open = TypeVar("Open")  # what a stream keeps for one open tool call (a content block, an output item)


class ChunkStream(ABC, Generic[Open]):
    """Chat chunks in (`feed`), another API's stream events out.

    The reading and the order are shared: the first chunk starts the stream (`_start`), reasoning
    and content text go to `_text` with the API's kind for each, a tool call opens through
    `_open_call` (only the first one when parallel calls are off; the others are dropped, their
    fragments too) and collects its fragments in `_call_args`, the finish closes what is open
    (`_close`, which `_closing` says the events of), and the usage chunk (the chat stream's last)
    ends the stream (`_end`). `_open` is the block or item being streamed, if any.
    """

    REASONING: str  # the API's kind for reasoning text
    CONTENT: str  # ... and for content text

    def __init__(self, *, parallel_calls: bool) -> None:
        self._reader = ChunkReader()
        self._parallel_calls = parallel_calls
        self._calls: dict[int, Open | None] = {}  # chat call index -> what it opened (None: dropped)
        self._open: Open | None = None
        self._ended = False
        self._finish: str | None = None
        self._stopping_word = ""
        self._report: Mapping[str, object] | None = None  # the engine's `slotkeeper` (how it reused it)

    def feed(self, chunk: Mapping[str, object]) -> list[Event]:
        """The events for one chat chunk (the first chunk also starts the stream)."""
        if self._ended:
            return []
        pieces = self._reader.feed(chunk)
        self._report = self._reader.report
        out = self._start()
        progress = chunk.get("prompt_progress")
        if isinstance(progress, dict):  # llama-server's `return_progress`
            out = self._progress(out, progress, _object(chunk.get("timings")))
        text: list[Event] = []  # the events of this chunk's text, which its `timings` belong to
        for piece in pieces:
            if isinstance(piece, Reasoning):
                text = self._text(self.REASONING, piece.text)
                out += text
            elif isinstance(piece, Text):
                text = self._text(self.CONTENT, piece.text)
                out += text
            elif isinstance(piece, CallStart):
                out += self._call_start(piece)
            elif isinstance(piece, CallArgs):
                opened = self._calls.get(piece.index)
                if opened is not None:
                    out += self._call_args(opened, piece.fragment)
            elif isinstance(piece, Finish):
                self._finish, self._stopping_word = piece.reason, piece.stopping_word
                out += self._close()
            elif isinstance(piece, UsageSeen):
                out += self._end(piece.usage)
        timings = chunk.get("timings")
        if text and isinstance(timings, dict) and not any(isinstance(p, Finish) for p in pieces):
            self._timed(text[-1], timings)  # `timings_per_token`: a token's chunk
        return out

    def _progress(
        self, out: list[Event], progress: Mapping[str, object], timings: Mapping[str, object]
    ) -> list[Event]:
        """`out` with a prompt progress report (`prompt_progress`, and the `timings` so far when
        the chunk has them) in the API's form; the default drops it (llama-server's Messages stream
        shows none)."""
        return out

    def _timed(self, event: Event, timings: Mapping[str, object]) -> None:
        """Put a token's `timings` (`timings_per_token`) on the last event of its text; the
        default drops them."""

    def finish(self) -> list[Event]:
        """The closing events when the chat stream ended without a usage chunk (none if ended)."""
        if self._ended:
            return []
        return self._start() + self._end(Usage())

    def _call_start(self, piece: CallStart) -> list[Event]:
        if not self._parallel_calls and any(c is not None for c in self._calls.values()):
            self._calls[piece.index] = None  # one call only: the others are dropped
            return []
        opened, out = self._open_call(Call(piece.id, piece.name, ""))
        self._calls[piece.index] = opened
        return out

    @abstractmethod
    def _start(self) -> list[Event]:
        """The opening events, once (none after the first call)."""

    @abstractmethod
    def _text(self, kind: str, text: str) -> list[Event]: ...

    @abstractmethod
    def _open_call(self, call: Call) -> tuple[Open, list[Event]]: ...

    @abstractmethod
    def _call_args(self, opened: Open, fragment: str) -> list[Event]: ...

    def _close(self) -> list[Event]:
        """Close the open block or item (no events when nothing is open)."""
        opened, self._open = self._open, None
        return [] if opened is None else self._closing(opened)

    @abstractmethod
    def _closing(self, opened: Open) -> list[Event]:
        """The events that close `opened`, with its final state."""

    @abstractmethod
    def _end(self, usage: Usage) -> list[Event]:
        """Close what is open and end the stream."""

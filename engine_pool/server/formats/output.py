"""A chat completion's output read as reasoning, content and tool calls, incrementally.

`ChatOutput` chains the reasoning split (`reasoning.ReasoningStream`) and the family's tool-call
stream (`calls.CallStream`): reasoning first, then calls are looked for in the content only.
Streamed and whole responses both feed it the generation's text deltas in order and differ only in
how they send the pieces (`assemble` joins them into one message), so they cannot disagree.

`--reasoning-format` (llama-server's names) decides where reasoning goes: `auto` and `deepseek`
into `reasoning_content`; `none` leaves the output as it is (reasoning and tags in the content);
`deepseek-legacy` does both: `reasoning_content`, and the content as the model wrote it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .calls import CallStream, ToolCall
from .reasoning import Markup, Reasoning, ReasoningStream

Piece = str | Reasoning | ToolCall

# --reasoning-format -> (split the reasoning out, keep the block's text in the content too)
REASONING_FORMATS: dict[str, tuple[bool, bool]] = {
    "auto": (True, False),
    "deepseek": (True, False),
    "deepseek-legacy": (True, True),
    "none": (False, False),
}


class ChatOutput:
    """Text deltas in; content strings, Reasoning and ToolCalls out, in order.

    `calls`: the tool-call stream, None when calls are not parsed (no tools, tool_choice none);
    `opened`: the prompt left a reasoning block open (`reasoning.opened_by`).
    """

    def __init__(self, calls: CallStream | None, reasoning_format: str, opened: bool) -> None:
        split, self._legacy = REASONING_FORMATS[reasoning_format]
        self._reasoning = ReasoningStream(opened) if split else None
        self._calls = calls
        self.reasoning_tokens = 0  # generated tokens that arrived while a reasoning block was open

    def feed(self, text: str, n_tokens: int = 0) -> list[Piece]:
        if self._reasoning is None:
            return self._content(text)
        before = self._reasoning.thinking
        parts = self._reasoning.feed(text)
        if before or self._reasoning.thinking:
            self.reasoning_tokens += n_tokens
        return self._route(parts)

    def finish(self) -> list[Piece]:
        out = self._route(self._reasoning.finish()) if self._reasoning is not None else []
        if self._calls is not None:
            out += self._calls.finish()
        return out

    def _route(self, parts: list[str | Reasoning | Markup]) -> list[Piece]:
        out: list[Piece] = []
        for p in parts:
            if isinstance(p, str):
                out += self._content(p)
                continue
            if isinstance(p, Reasoning):
                out.append(p)
            if self._legacy:
                # The block comes first in the output, before any content reached the call stream,
                # so its text can go out directly without changing the order.
                out.append(p.text)
        return out

    def _content(self, text: str) -> list[Piece]:
        return list(self._calls.feed(text)) if self._calls is not None else [text]


@dataclass(frozen=True)
class ChatMessage:
    content: str | None  # None only beside tool calls (when empty or only whitespace)
    reasoning: str
    calls: list[ToolCall]


def assemble(pieces: list[Piece]) -> ChatMessage:
    """One message from all of an output's pieces. A reply without tool calls always has text, ""
    at least (an empty generation, or reasoning only): clients read `content` as a string."""
    content = "".join(p for p in pieces if isinstance(p, str))
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    reasoning = "".join(p.text for p in pieces if isinstance(p, Reasoning))
    return ChatMessage((content.strip() or None) if calls else content, reasoning, calls)

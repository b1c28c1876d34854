"""Reasoning blocks: `<think>…</think>` at the start of the output, split from the content.

A reasoning model writes its reasoning first, between `<think>` and `</think>`, then the answer.
Some templates open the block themselves: Qwen3.5 and Nemotron-3 end the generation prompt with
`<think>\\n`, so the model writes only the reasoning and `</think>`. Whether the block is already
open is read from the rendered prompt's tail (`opened_by`), so `chat_template_kwargs` such as
`enable_thinking: false` (which makes those templates write an empty, closed block) are honoured
whatever the template. Like llama.cpp, reasoning is recognised only at the start of the output,
and a block the output never closes (generation stopped while reasoning) is all reasoning.

`ReasoningStream` does this incrementally: text that may still turn out to be the opening or the
closing tag is held back. The reasoning is stripped of surrounding whitespace, and so is the
start of the content after `</think>`; tags and that whitespace come out as `Markup`, which
`--reasoning-format deepseek-legacy` keeps in the content while the others drop it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...protocol.chat_result import Reasoning  # one piece type for reasoning: our output, chat streams
from ..grammar import THINK_CLOSE  # one spelling for this reader and the grammars' reasoning prefix
from .calls import partial_suffix

THINK_OPEN = "<think>"

_START, _THINKING, _AFTER, _CONTENT = "start", "thinking", "after", "content"


def opened_by(prompt: str) -> bool:
    """Whether the rendered prompt leaves a reasoning block open for the model to continue."""
    return prompt.rstrip().endswith(THINK_OPEN)


@dataclass(frozen=True)
class Markup:
    """The block's own text: its tags and the whitespace around them and around the reasoning."""

    text: str


class ReasoningStream:
    """Text deltas in; Reasoning, Markup and content strings out, in order."""

    def __init__(self, opened: bool) -> None:
        self._state = _THINKING if opened else _START
        self._buf = ""
        self._started = False  # reasoning text seen (until then, whitespace is leading: dropped)
        self._ws = ""  # trailing reasoning whitespace: dropped at the block's end, kept if more follows

    @property
    def thinking(self) -> bool:
        """Inside the reasoning block."""
        return self._state == _THINKING

    def feed(self, text: str) -> list[str | Reasoning | Markup]:
        self._buf += text
        out: list[str | Reasoning | Markup] = []
        while True:
            if self._state == _START:
                rest = self._buf.lstrip()
                if rest.startswith(THINK_OPEN):
                    out.append(Markup(self._buf[: len(self._buf) - len(rest)] + THINK_OPEN))
                    self._buf, self._state = rest[len(THINK_OPEN) :], _THINKING
                elif THINK_OPEN.startswith(rest):
                    return out  # whitespace, or the beginning of the tag: not decided yet
                else:
                    self._state = _CONTENT
            elif self._state == _THINKING:
                i = self._buf.find(THINK_CLOSE)
                if i < 0:
                    keep = len(self._buf) - partial_suffix(self._buf, THINK_CLOSE)
                    self._reasoning(self._buf[:keep], out)
                    self._buf = self._buf[keep:]
                    return out
                self._reasoning(self._buf[:i], out)
                out.append(Markup(self._ws + THINK_CLOSE))
                self._ws, self._buf, self._state = "", self._buf[i + len(THINK_CLOSE) :], _AFTER
            elif self._state == _AFTER:
                rest = self._buf.lstrip()
                if len(rest) < len(self._buf):
                    out.append(Markup(self._buf[: len(self._buf) - len(rest)]))
                self._buf = rest
                if not rest:
                    return out
                self._state = _CONTENT
            else:
                if self._buf:
                    out.append(self._buf)
                self._buf = ""
                return out

    def finish(self) -> list[str | Reasoning | Markup]:
        out: list[str | Reasoning | Markup] = []
        if self._state == _THINKING:
            self._reasoning(self._buf, out)
            if self._ws:
                out.append(Markup(self._ws))
        elif self._buf:  # undecided text (whitespace, a partial tag) is content
            out.append(self._buf)
        self._buf, self._ws = "", ""
        return out

    def _reasoning(self, text: str, out: list[str | Reasoning | Markup]) -> None:
        if not self._started:
            rest = text.lstrip()
            if len(rest) < len(text):
                out.append(Markup(text[: len(text) - len(rest)]))
            text = rest
            self._started = bool(text)
        body = text.rstrip()
        if body:
            out.append(Reasoning(self._ws + body))
            self._ws = text[len(body) :]
        else:
            self._ws += text

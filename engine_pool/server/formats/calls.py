"""Tool calls in generated text: the call, and the block scanner every family's format shares.

Every supported family writes a call as a block between an opening and a closing tag
(`<tool_call>…</tool_call>`, `<|tool_call_start|>…<|tool_call_end|>`); only what is inside differs.
`CallStream` splits text into content and calls incrementally: content is released as soon as it
cannot be the start of a block, a block's calls as soon as it closes. A block the family's parser
does not read as calls is not one: its text stays in the content, so nothing the model wrote is
lost. A block still open when the text ends is read too (generation may stop on the closing tag or
on end-of-generation), and stays content when it does not parse.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...protocol.engine_answers import MessageToolCall


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def as_openai(self) -> MessageToolCall:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def arguments_json(value: Any) -> str:
    """`value` as OpenAI's arguments text.

    Non-ASCII characters stay readable, except when the value holds a lone surrogate (`"\\ud800"`
    is valid JSON): such a string cannot be encoded as UTF-8, so the response could not be sent.
    """
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value, ensure_ascii=True)
    return text


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads_json(text: str) -> Any:
    """`json.loads` without NaN and Infinity, which Python reads but no JSON parser does: arguments
    holding them could not be sent on as JSON. Raises ValueError, also for nesting too deep for
    Python's parser (model output is not bounded in depth)."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("the JSON nests too deeply") from None


# A family's reading of the text between its tags: the calls, or None when it is not a call block.
BlockParser = Callable[[str], "list[ToolCall] | None"]


class CallStream:
    """Text deltas in; content strings and ToolCalls out, in order."""

    def __init__(self, open_tag: str, close_tag: str, parse: BlockParser) -> None:
        self.open_tag, self.close_tag, self.parse = open_tag, close_tag, parse
        self._buf = ""
        self._inside = False
        self._pending_ws = ""  # whitespace held until real content follows (dropped around calls)
        self.n_calls = 0

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buf += text
        out: list[str | ToolCall] = []
        while True:
            if not self._inside:
                i = self._buf.find(self.open_tag)
                if i < 0:
                    keep = partial_suffix(self._buf, self.open_tag)
                    self._content(self._buf[: len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                self._content(self._buf[:i], out)
                self._buf = self._buf[i + len(self.open_tag) :]
                self._inside = True
            else:
                j = self._buf.find(self.close_tag)
                if j < 0:
                    return out
                self._close(self._buf[:j], out, closed=True)
                self._buf = self._buf[j + len(self.close_tag) :]
                self._inside = False

    def finish(self) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        if self._inside:
            self._close(self._buf, out, closed=False)
        else:
            self._content(self._buf, out)
        self._buf, self._inside = "", False
        if self.n_calls == 0 and self._pending_ws:
            out.append(self._pending_ws)
        self._pending_ws = ""
        return out

    def _close(self, block: str, out: list[str | ToolCall], *, closed: bool) -> None:
        calls = self.parse(block)
        if not calls:
            self._content(self.open_tag + block + (self.close_tag if closed else ""), out)
            return
        self._pending_ws = ""
        self.n_calls += len(calls)
        out.extend(calls)

    def _content(self, text: str, out: list[str | ToolCall]) -> None:
        if not text:
            return
        if not text.strip():
            self._pending_ws += text
            return
        if self.n_calls:  # text after a call: its leading whitespace is the separator
            self._pending_ws, text = "", (self._pending_ws + text).lstrip()
        out.append(self._pending_ws + text)
        self._pending_ws = ""


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0

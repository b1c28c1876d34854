"""Tool calls in generated text, for the `<tool_call>{json}</tool_call>` family (Qwen, Hermes).

`parse_tool_calls` splits a finished text into content and calls; `ToolCallStream` does the same
incrementally for streaming, releasing content as soon as it cannot be the start of a call and each
call as soon as its block closes. A block whose JSON does not parse as `{"name": ..., "arguments":
...}` is not a call: its text stays in the content, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def as_openai(self) -> dict[str, object]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def parse_call(block: str) -> ToolCall | None:
    """The call in the text between the tags, or None when it is not one."""
    try:
        data = json.loads(block.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    args = data.get("arguments", data.get("parameters", {}))
    return ToolCall(data["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content or None when only whitespace is left, calls in order)."""
    stream = ToolCallStream()
    parts = stream.feed(text) + stream.finish()
    content = "".join(p for p in parts if isinstance(p, str))
    calls = [p for p in parts if isinstance(p, ToolCall)]
    return (content.strip() or None) if calls else (content or None), calls


class ToolCallStream:
    """Text deltas in; content strings and ToolCalls out, in order."""

    def __init__(self) -> None:
        self._buf = ""
        self._inside = False
        self._pending_ws = ""  # whitespace held until real content follows (dropped around calls)
        self.n_calls = 0

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buf += text
        out: list[str | ToolCall] = []
        while True:
            if not self._inside:
                i = self._buf.find(OPEN)
                if i < 0:
                    keep = _partial_suffix(self._buf, OPEN)
                    self._content(self._buf[: len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                self._content(self._buf[:i], out)
                self._buf = self._buf[i + len(OPEN) :]
                self._inside = True
            else:
                j = self._buf.find(CLOSE)
                if j < 0:
                    return out
                self._close(self._buf[:j], out, closed=True)
                self._buf = self._buf[j + len(CLOSE) :]
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
        call = parse_call(block)
        if call is None:
            self._content(OPEN + block + (CLOSE if closed else ""), out)
            return
        self._pending_ws = ""
        self.n_calls += 1
        out.append(call)

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


def _partial_suffix(text: str, tag: str) -> int:
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0

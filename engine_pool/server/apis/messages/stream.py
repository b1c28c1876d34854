"""A chat completion stream as Anthropic Messages stream events. Pure.

`message_start` (the message with no content yet; its usage the prompt's size, from the chat
stream's first chunk), then per content block `content_block_start`, `content_block_delta`s
(`thinking_delta`, `text_delta`, `input_json_delta`) and `content_block_stop`; then `message_delta`
with the stop reason and the whole usage (the chat stream's usage chunk is its last, so the split
into computed and reused input tokens arrives here, where the SDK takes it over the start's) and
`message_stop`. A tool call's input goes out as one
`input_json_delta` when its block closes: the same object the non-streamed message would hold, also
for arguments that are not a JSON object. A failure after the start is `event: error` in Anthropic's
error shape (`failed`).
"""

from __future__ import annotations

import json
from typing import Any

from ....errors import ApiError, error_payload
from ..chat_result import Call, CallArgs, CallStart, ChunkReader, Finish, Reasoning, Text, Usage, UsageSeen
from .output import cache_miss_reason, message_shell, stop_reason, tool_input, tool_use_id, usage_object
from .request import MessagesRequest

Event = tuple[str, dict[str, Any]]

_DELTAS = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text")}


class _Block:
    def __init__(self, kind: str, index: int, call: Call | None = None) -> None:
        self.kind = kind  # thinking | text | tool_use
        self.index = index
        self.call = call
        self.arguments = ""


class MessageStream:
    """Chat chunks in (`feed`), Messages events out."""

    def __init__(self, req: MessagesRequest, *, message_id: str) -> None:
        self.req = req
        self.message_id = message_id
        self._reader = ChunkReader()
        self._started = False
        self._ended = False
        self._blocks: list[_Block] = []
        self._open: _Block | None = None
        self._calls: dict[int, _Block | None] = {}  # chat call index -> its block (None: dropped)
        self._finish: str | None = None
        self._stopping_word = ""
        self._report: dict[str, Any] | None = None  # the engine's `slotkeeper` (how it reused the prompt)

    def _start(self) -> list[Event]:
        if self._started:
            return []
        self._started = True
        message = message_shell(self.req, message_id=self.message_id, model=self._reader.model)
        # The prompt's size, as llama-server reports it here; how much of it was reused is known
        # only once the generation is done (`message_delta` carries the whole usage).
        message["usage"] = usage_object(Usage(prompt_tokens=self._reader.prompt_tokens))
        if self.req.diagnostics:
            message["diagnostics"] = {"cache_miss_reason": None}
        return [("message_start", {"type": "message_start", "message": message})]

    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        if self._ended:
            return []
        pieces = self._reader.feed(chunk)
        self._report = self._reader.report
        out = self._start()
        for piece in pieces:
            if isinstance(piece, Reasoning):
                out += self._text("thinking", piece.text)
            elif isinstance(piece, Text):
                out += self._text("text", piece.text)
            elif isinstance(piece, CallStart):
                out += self._call_start(piece)
            elif isinstance(piece, CallArgs):
                block = self._calls.get(piece.index)
                if block is not None:
                    block.arguments += piece.fragment
            elif isinstance(piece, Finish):
                out += self._close()
                self._finish, self._stopping_word = piece.reason, piece.stopping_word
            elif isinstance(piece, UsageSeen):
                out += self._end(piece.usage)
        return out

    def finish(self) -> list[Event]:
        """The closing events when the chat stream ended without a usage chunk (none if ended)."""
        if self._ended:
            return []
        return self._start() + self._end(Usage())

    def failed(self, err: ApiError) -> list[Event]:
        """A failure after the stream started: one `error` event (the SDK raises it)."""
        self._ended = True
        return [("error", error_payload(err, "anthropic"))]

    def _add(self, kind: str, call: Call | None = None) -> tuple[_Block, list[Event]]:
        out = self._close()
        block = _Block(kind, len(self._blocks), call)
        self._blocks.append(block)
        self._open = block
        if kind == "tool_use":
            assert call is not None
            start: dict[str, Any] = {
                "type": "tool_use",
                "id": tool_use_id(call.id),
                "name": call.name,
                "input": {},
            }
        elif kind == "thinking":
            start = {"type": "thinking", "thinking": "", "signature": ""}
        else:
            start = {"type": "text", "text": ""}
        out.append(
            (
                "content_block_start",
                {"type": "content_block_start", "index": block.index, "content_block": start},
            )
        )
        return block, out

    def _text(self, kind: str, text: str) -> list[Event]:
        out: list[Event] = []
        block = self._open
        if block is None or block.kind != kind:
            block, out = self._add(kind)
        delta_type, key = _DELTAS[kind]
        delta = {"type": delta_type, key: text}
        out.append(
            ("content_block_delta", {"type": "content_block_delta", "index": block.index, "delta": delta})
        )
        return out

    def _call_start(self, piece: CallStart) -> list[Event]:
        if not self.req.parallel_tool_calls and any(b.kind == "tool_use" for b in self._blocks):
            self._calls[piece.index] = None  # disable_parallel_tool_use: the first call only
            return []
        block, out = self._add("tool_use", Call(piece.id, piece.name, ""))
        self._calls[piece.index] = block
        return out

    def _close(self) -> list[Event]:
        block, self._open = self._open, None
        if block is None:
            return []
        out: list[Event] = []
        if block.kind == "tool_use":
            partial = json.dumps(tool_input(block.arguments), ensure_ascii=False)
            delta = {"type": "input_json_delta", "partial_json": partial}
            out.append(
                ("content_block_delta", {"type": "content_block_delta", "index": block.index, "delta": delta})
            )
        out.append(("content_block_stop", {"type": "content_block_stop", "index": block.index}))
        return out

    def _end(self, usage: Usage) -> list[Event]:
        out = self._close()
        self._ended = True
        has_calls = any(b.kind == "tool_use" for b in self._blocks)
        reason, sequence = stop_reason(self._finish, self._stopping_word, has_calls)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage_object(usage),
        }
        if self._report is not None:
            delta["slotkeeper"] = self._report
        if self.req.diagnostics:  # (message_start said null: the comparison was not done then)
            delta["diagnostics"] = {"cache_miss_reason": cache_miss_reason(self.req, self._report, usage)}
        out.append(("message_delta", delta))
        out.append(("message_stop", {"type": "message_stop"}))
        return out

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

from engine_pool.errors import ApiError, error_payload

from ..chat_result import Call, ChunkStream, Event, Usage
from .output import cache_miss_reason, message_shell, stop_reason, tool_input, tool_use_id, usage_object
from .request import MessagesRequest

_DELTAS = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text")}


class _Block:
    def __init__(self, kind: str, index: int, call: Call | None = None) -> None:
        self.kind = kind  # thinking | text | tool_use
        self.index = index
        self.call = call
        self.arguments = ""


class MessageStream(ChunkStream[_Block]):
    """Chat chunks in (`feed`), Messages events out."""

    REASONING = "thinking"
    CONTENT = "text"

    def __init__(self, req: MessagesRequest, *, message_id: str) -> None:
        super().__init__(parallel_calls=req.parallel_tool_calls)  # off: disable_parallel_tool_use
        self.req = req
        self.message_id = message_id
        self._started = False
        self._blocks: list[_Block] = []

    def _start(self) -> list[Event]:
        if self._started:
            return []
        self._started = True
        message = message_shell(self.req, message_id=self.message_id, model=self._reader.model)
        # The prompt's size, as llama-server reports it here; how much of it was reused is known
        # only once the decode run is done (`message_delta` carries the whole usage).
        message["usage"] = usage_object(Usage(prompt_tokens=self._reader.prompt_tokens))
        if self.req.diagnostics:
            message["diagnostics"] = {"cache_miss_reason": None}
        return [("message_start", {"type": "message_start", "message": message})]

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

    def _open_call(self, call: Call) -> tuple[_Block, list[Event]]:
        return self._add("tool_use", call)

    def _call_args(self, opened: _Block, fragment: str) -> list[Event]:
        opened.arguments += fragment  # sent whole when the block closes
        return []

    def _closing(self, block: _Block) -> list[Event]:
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

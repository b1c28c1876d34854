"""A chat completion stream as a Responses event stream, in the order the OpenAI SDK accumulates. Pure.

Per response: `response.created`, `response.in_progress`; per output item `response.output_item.added`,
then for a reasoning item `response.content_part.added` (reasoning_text), `response.reasoning_text.
delta`..., `response.reasoning_text.done`, `response.content_part.done`; for a message the same with
`output_text`; for a function call `response.function_call_arguments.delta`..., `.done`; for a
custom tool call `response.custom_tool_call_input.delta` and `.done` once its call is complete (its
input is read from the whole arguments); then `response.output_item.done` (a reasoning item's
carries `encrypted_content` when the request includes it and the stream can seal). The stream ends
with `response.completed`, or `response.incomplete` when the token limit cut it (both carry the
whole response, usage included) — sent once the chat stream's usage chunk arrived (its last), or
at `finish()` when a chat stream ended without one.
With llama-server's `return_progress`, each prompt progress report rides on a `response.in_progress`
event (`prompt_progress`); with `timings_per_token`, a text delta carries the `timings` so far; the
last event carries the generation's `timings` beside the response, as llama-server's.
Every event carries `sequence_number`, counting from 0. A failure after the start is an `error`
event and `response.failed` (`failed`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine_pool.errors import ApiError

from ..chat_result import Call, ChunkStream, Event, Usage
from .objects import OutputItem, ResponseObject
from .output import (
    Seal,
    call_item,
    call_prefix,
    finalize,
    is_incomplete,
    mark_failed,
    message_item,
    new_id,
    reasoning_item,
    response_shell,
    sealer,
    text_part,
    with_report,
)
from .request import ResponsesRequest
from .tools import custom_input


class _Item:
    """One output item while it streams: its kind, index, id and the text or arguments so far."""

    def __init__(self, kind: str, index: int, item_id: str, call: Call | None = None) -> None:
        self.kind = kind  # reasoning | message | function_call | custom_tool_call
        self.index = index
        self.id = item_id
        self.call = call
        self.text = ""
        self.done: OutputItem | None = None


class ResponseStream(ChunkStream[_Item]):
    """Chat chunks in (`feed`), Responses events out; `response` is the final object once complete."""

    REASONING = "reasoning"
    CONTENT = "message"

    def __init__(
        self, req: ResponsesRequest, *, response_id: str, created_at: int, seal: Seal = None
    ) -> None:
        super().__init__(parallel_calls=req.parallel_tool_calls)
        self.req = req
        self._seal = sealer(req, seal)
        self.response_id = response_id
        self.created_at = created_at
        self.response: ResponseObject | None = None
        self._seq = 0
        self._started = False
        self._items: list[_Item] = []

    # -- events -------------------------------------------------------------------------------
    def _event(self, kind: str, **payload: Any) -> Event:
        data = {"type": kind, "sequence_number": self._seq, **payload}
        self._seq += 1
        return kind, data

    def _shell(self, status: str) -> ResponseObject:
        return response_shell(
            self.req,
            response_id=self.response_id,
            created_at=self.created_at,
            model=self._reader.model,
            status=status,
        )

    def _start(self) -> list[Event]:
        if self._started:
            return []
        self._started = True
        return [
            self._event("response.created", response=self._shell("in_progress")),
            self._event("response.in_progress", response=self._shell("in_progress")),
        ]

    def _progress(
        self, out: list[Event], progress: Mapping[str, object], timings: Mapping[str, object]
    ) -> list[Event]:
        # llama-server's: on the `response.in_progress` that opens the stream, later on one of its own.
        if not out:
            out = [self._event("response.in_progress", response=self._shell("in_progress"))]
        data = out[-1][1]
        if timings:
            data["timings"] = timings
        data["prompt_progress"] = progress
        return out

    def _timed(self, event: Event, timings: Mapping[str, object]) -> None:
        event[1]["timings"] = timings

    def failed(self, err: ApiError) -> list[Event]:
        """A failure after the stream started: `error` (the error's own code and message), then
        `response.failed` with the output so far. Starts the response first if nothing was sent."""
        out = self._start()
        self._ended = True
        out.append(self._event("error", code=err.code, message=err.message, param=err.param))
        response = self._shell("in_progress")
        mark_failed(response, [i.done or self._snapshot(i) for i in self._items], err)
        out.append(self._event("response.failed", response=response))
        return out

    # -- items --------------------------------------------------------------------------------
    def _snapshot(self, item: _Item) -> OutputItem:
        """An item as it stands (in progress)."""
        if item.kind == "reasoning":
            return reasoning_item(item.id, item.text, "in_progress")
        if item.kind == "message":
            return message_item(item.id, item.text, "in_progress")
        assert item.call is not None
        text = item.text if item.kind == "function_call" else ""  # a custom input: once complete
        return call_item(self.req, item.id, Call(item.call.id, item.call.name, text), "in_progress")

    def _add(self, kind: str, call: Call | None = None) -> tuple[_Item, list[Event]]:
        out = self._close()
        prefix = {"reasoning": "rs_", "message": "msg_"}.get(kind) or call_prefix(self.req, call)  # type: ignore[arg-type]
        item = _Item(kind, len(self._items), new_id(prefix), call)
        self._items.append(item)
        self._open = item
        added: OutputItem
        if kind == "reasoning":
            added = reasoning_item(item.id, "", "in_progress") | {"content": []}
        elif kind == "message":
            added = message_item(item.id, None, "in_progress")
        else:
            added = self._snapshot(item)
        out.append(self._event("response.output_item.added", output_index=item.index, item=added))
        if kind in ("reasoning", "message"):
            out.append(self._part_event("response.content_part.added", item, ""))
        return item, out

    def _part_event(self, kind: str, item: _Item, text: str) -> Event:
        part = text_part(text) if item.kind == "message" else {"type": "reasoning_text", "text": text}
        return self._event(kind, item_id=item.id, output_index=item.index, content_index=0, part=part)

    def _text(self, kind: str, text: str) -> list[Event]:
        out: list[Event] = []
        item = self._open
        if item is None or item.kind != kind:
            item, out = self._add(kind)
        item.text += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        out.append(
            self._event(name, item_id=item.id, output_index=item.index, content_index=0, delta=text, **extra)
        )
        return out

    def _open_call(self, call: Call) -> tuple[_Item, list[Event]]:
        tool = self.req.tools.named(call.name)
        return self._add("custom_tool_call" if tool and tool.kind == "custom" else "function_call", call)

    def _call_args(self, opened: _Item, fragment: str) -> list[Event]:
        if opened.done is not None:
            return []
        opened.text += fragment
        if opened.kind == "custom_tool_call":  # its input is read from the whole arguments
            return []
        return [
            self._event(
                "response.function_call_arguments.delta",
                item_id=opened.id,
                output_index=opened.index,
                delta=fragment,
            )
        ]

    def _closing(self, item: _Item) -> list[Event]:
        out: list[Event] = []
        if item.kind == "custom_tool_call":
            assert item.call is not None
            item.done = call_item(
                self.req, item.id, Call(item.call.id, item.call.name, item.text), "completed"
            )
            text = custom_input(item.text)
            where = {"item_id": item.id, "output_index": item.index}
            if text:
                out.append(self._event("response.custom_tool_call_input.delta", **where, delta=text))
            out.append(self._event("response.custom_tool_call_input.done", **where, input=text))
        elif item.kind == "function_call":
            assert item.call is not None
            item.done = call_item(
                self.req, item.id, Call(item.call.id, item.call.name, item.text), "completed"
            )
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=item.index,
                    arguments=item.text,
                )
            )
        else:
            # Closed by the finish (or by the next item): the finish reason says if it was cut.
            status = "incomplete" if is_incomplete(self._finish) else "completed"
            message = item.kind == "message"
            if message:
                item.done = message_item(item.id, item.text, status)
            else:
                sealed = self._seal(item.text) if self._seal is not None and item.text else None
                item.done = reasoning_item(item.id, item.text, status, sealed)
            name = "response.output_text.done" if message else "response.reasoning_text.done"
            extra: dict[str, Any] = {"logprobs": []} if message else {}
            out.append(
                self._event(
                    name, item_id=item.id, output_index=item.index, content_index=0, text=item.text, **extra
                )
            )
            out.append(self._part_event("response.content_part.done", item, item.text))
        out.append(self._event("response.output_item.done", output_index=item.index, item=item.done))
        return out

    def _end(self, usage: Usage) -> list[Event]:
        out = self._close()
        self._ended = True
        response = self._shell("in_progress")
        finalize(response, [i.done for i in self._items if i.done is not None], self._finish, usage)
        with_report(response, self._report)
        self.response = response
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        out.append(self._event(kind, response=response))
        if self._reader.timings is not None:  # llama-server's: the generation's, beside the response
            out[-1][1]["timings"] = self._reader.timings
        return out

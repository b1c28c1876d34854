"""A stream's restore progress: llama-server's `return_progress` carried on to what llama-server
does not do — a session's state brought back from its slot file or the store before its prompt
is evaluated.

A streamed chat or completion that asks for `return_progress`, and whose turn fills its slot (its
own stored state, or another session's stored prefix), starts its stream as the node sends the
fill's first report, with the headers known then (`X-Session-Id`; `X-Slotkeeper-Cache` as placed:
"restored", or "stored-prefix"). Each report becomes a chunk of the stream's API with no choices
and a `restore_progress` object:

    {"stage": "fetching" | "restoring" | "restored" | "failed", "bytes": n, "total": N, "time_ms": t}

— "fetching" as the state's bytes come from the store (`bytes` of `total`), "restoring" as the
engine loads it, "restored" when it is in the slot (with the `tokens` it holds), "failed" when it
did not take (the prompt is then evaluated in full; the header said what was planned). The
engine's stream follows as it would have come, its `prompt_progress` reports first. A failure
after the stream began is its last event, `data: {"error": {...}}`. A turn whose slot needs no
fill, or a fill that ends before its first report, is answered as without this. Chat and
completions only: the Responses and Messages streams are the gateway's translations, whose first
events come from the engine's answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from typing import Any

import structlog
from starlette.responses import Response, StreamingResponse

from engine_pool.errors import api_error, error_payload, is_expected
from engine_pool.http.reports import Reports
from engine_pool.protocol.node import FillProgress, FillResult
from engine_pool.protocol.sse import event
from gateway.turn.engine_call import CHAT_PATH
from gateway.turn.forward import headers_for
from gateway.turn.slot_choice import Placement

log = structlog.get_logger("slotkeeper.gateway")


def wanted(body: Mapping[str, Any], passthrough: bool) -> bool:
    """Whether a turn's request asks for its restore's progress: a stream with `return_progress`
    that the gateway passes through (chat, completions). Pure."""
    return passthrough and body.get("stream") is True and body.get("return_progress") is True


class RestoreProgress:
    """One turn's restore progress (the module doc): a `FillWatcher` for its placement, and the
    response that streams what it was told. Owned by the request's handler."""

    def __init__(self, path: str, model: str) -> None:
        self._reports: Reports[bytes] = Reports()
        self._chat = path == CHAT_PATH
        self._model = model
        self._id = ("chatcmpl-" if self._chat else "cmpl-") + uuid.uuid4().hex
        self._headers: dict[str, str] | None = None
        self._sent: FillProgress | None = None  # the last of the node's reports

    # -- the watcher (gateway.turn.place.FillWatcher) ------------------------------------------
    def filling(
        self, session: str, placement: Placement, forked_from: str | None
    ) -> Callable[[FillProgress], None]:
        if self._headers is None:  # (a turn placed again keeps the stream's first headers)
            self._headers = headers_for(session, placement, forked_from)
        return self._report

    def filled(self, result: FillResult | None) -> None:
        last = self._sent
        if last is None:  # no report went out: nothing began that needs an end
            return
        if result is None:
            self._send({"stage": "failed", "bytes": last.bytes, "total": last.total, "time_ms": int(last.ms)})
        else:
            done = {
                "stage": "restored",
                "bytes": result.bytes,
                "total": last.total,
                "time_ms": int(result.ms),
            }
            self._send({**done, "tokens": result.tokens})
        self._sent = None

    def _report(self, p: FillProgress) -> None:
        self._sent = p
        self._send({"stage": p.stage, "bytes": p.bytes, "total": p.total, "time_ms": int(p.ms)})

    def _send(self, progress: dict[str, Any]) -> None:
        head: dict[str, Any] = {
            "id": self._id,
            "object": "chat.completion.chunk" if self._chat else "text_completion",
        }
        chunk = {**head, "created": int(time.time()), "model": self._model, "choices": []}
        self._reports.send(event({**chunk, "restore_progress": progress}))

    # -- the response ---------------------------------------------------------------------------
    async def respond(self, turn: Coroutine[Any, Any, Response]) -> Response:
        """The turn's response: its own when it answered before a fill's first report, else a
        stream of the reports, then of its answer."""
        task = asyncio.ensure_future(turn)
        try:
            first = await self._reports.first(task)
        except BaseException:
            await _settle(task, None)
            raise
        if first is None:
            return task.result()
        return StreamingResponse(
            self._events(first, task), media_type="text/event-stream", headers=self._headers
        )

    async def _events(self, first: bytes, task: asyncio.Future[Response]) -> AsyncIterator[bytes]:
        answer: Response | None = None
        try:
            yield first
            async for report in self._reports.rest(task):
                yield report
            try:
                answer = task.result()
            except Exception as exc:
                err = api_error(exc)
                if not is_expected(exc):
                    log.error("gateway.unhandled", error=err.message, exc_info=exc)
                yield event(error_payload(err))
                return
            assert isinstance(answer, StreamingResponse)  # (a streamed turn's answer)
            async for part in answer.body_iterator:
                yield part if isinstance(part, bytes) else str(part).encode()
        finally:
            await _settle(task, answer)


async def _settle(task: asyncio.Future[Response], answer: Response | None) -> None:
    """The turn's end where its stream ended early (the client left): a turn still being placed is
    cancelled (it lets its session go as a cancelled turn does), and an answer it came to is
    closed and its background run (the turn's bookkeeping, when its body never ran)."""
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
    if answer is None and task.done() and not task.cancelled() and task.exception() is None:
        answer = task.result()
    if answer is None:
        return
    aclose = getattr(answer.body_iterator, "aclose", None) if isinstance(answer, StreamingResponse) else None
    if aclose is not None:
        await aclose()
    if answer.background is not None:
        await answer.background()

"""The Python face of a native engine: routes the core's event stream to its requests.

The core pushes token/done/error events for every request into one queue and signals an eventfd.
This class is that queue's single consumer: an asyncio reader on the eventfd (`stream`), or a
blocking wait for scripts and tests (`generate`); use one style per engine.
"""

from __future__ import annotations

import asyncio
import codecs
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from . import _native
from .errors import EngineClosedError, NativeError


@dataclass
class Completion:
    """A finished request: sampled tokens, their text, why it stopped, and its timings."""

    request_id: int
    tokens: list[int] = field(default_factory=list)
    pieces: list[bytes] = field(default_factory=list)
    stop_reason: str = ""
    timings: _native.Timings | None = None
    slot: int = -1

    @property
    def text(self) -> str:
        return decode_pieces(self.pieces)


class _Sink:
    __slots__ = ("events", "done", "wake")

    def __init__(self) -> None:
        self.events: deque[_native.Event] = deque()
        self.done = False
        self.wake: asyncio.Event | None = None


class Engine:
    """One model, N slots. See native/_native.pyi for the operations it forwards."""

    def __init__(self, config: _native.EngineConfig) -> None:
        self._raw = _native.Engine(config)
        self._sinks: dict[int, _Sink] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    # -- plain forwards -------------------------------------------------------------------------
    @property
    def raw(self) -> _native.Engine:
        return self._raw

    @property
    def model(self) -> _native.ModelInfo:
        return self._raw.model

    @property
    def config(self) -> _native.EngineConfig:
        return self._raw.config

    @property
    def n_ctx_slot(self) -> int:
        return self._raw.n_ctx_slot

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self._raw.tokenize(text, add_special, parse_special)

    def detokenize(
        self, tokens: list[int], remove_special: bool = False, unparse_special: bool = True
    ) -> str:
        return self._raw.detokenize(tokens, remove_special, unparse_special)

    def token_piece(self, token: int, special: bool = True) -> bytes:
        return self._raw.token_piece(token, special)

    def slots(self) -> list[_native.SlotInfo]:
        return self._raw.slots()

    def slot_tokens(self, slot: int) -> list[int]:
        return self._raw.slot_tokens(slot)

    def metrics(self) -> dict[str, int]:
        return self._raw.metrics()

    def save_slot(self, slot: int, path: str) -> _native.SlotFileInfo:
        return self._raw.save_slot(slot, path)

    def restore_slot(self, slot: int, path: str) -> _native.SlotFileInfo:
        return self._raw.restore_slot(slot, path)

    def erase_slot(self, slot: int) -> int:
        return self._raw.erase_slot(slot)

    def cancel(self, request_id: int) -> bool:
        return self._raw.cancel(request_id)

    def close(self) -> None:
        """Stop the core; requests in flight end with their error event, streams included."""
        self._closed = True
        self._raw.close()
        self._route(self._raw.poll())  # the shutdown errors, before the reader goes away
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._raw.event_fd())
        self._loop = None
        for sink in self._sinks.values():
            if sink.wake is not None:
                sink.wake.set()

    # -- requests -------------------------------------------------------------------------------
    def submit(self, slot: int, params: _native.RequestParams) -> int:
        request_id = self._raw.submit(slot, params)
        self._sinks[request_id] = _Sink()
        return request_id

    def _route(self, events: list[_native.Event]) -> None:
        for ev in events:
            sink = self._sinks.get(ev.request_id)
            if sink is None:
                continue
            sink.events.append(ev)
            if ev.kind != "token":
                sink.done = True
            if sink.wake is not None:
                sink.wake.set()

    def generate(self, slot: int, params: _native.RequestParams, timeout_s: float = 600.0) -> Completion:
        """Run one request to the end, blocking. Raises NativeError on an error event."""
        request_id = self.submit(slot, params)
        return self.collect(request_id, timeout_s)

    def collect(self, request_id: int, timeout_s: float = 600.0) -> Completion:
        """Block until a submitted request ends and return it (tokens in order)."""
        sink = self._sinks[request_id]
        out = Completion(request_id)
        waited = 0.0
        try:
            while True:
                while sink.events:
                    if self._consume(out, sink.events.popleft()):
                        return out
                if waited >= timeout_s:
                    raise TimeoutError(f"request {request_id} did not finish in {timeout_s} s")
                self._route(self._raw.wait(0.5))
                waited += 0.5
        finally:
            self._sinks.pop(request_id, None)

    async def stream(self, slot: int, params: _native.RequestParams) -> AsyncGenerator[_native.Event, None]:
        """Submit and yield the request's events as they come (the last is done or error).

        Leaving the iteration early cancels the request.
        """
        self._attach()
        request_id = self.submit(slot, params)
        sink = self._sinks[request_id]
        sink.wake = asyncio.Event()
        finished = False
        try:
            while True:
                while sink.events:
                    ev = sink.events.popleft()
                    finished = ev.kind != "token"
                    yield ev
                    if finished:
                        return
                if self._closed:
                    raise EngineClosedError("the engine was closed")
                sink.wake.clear()
                await sink.wake.wait()
        finally:
            if not finished:
                # Synchronous and non-blocking: an await here would be cancelled with the task.
                self._raw.cancel_nowait(request_id)
            self._sinks.pop(request_id, None)

    def _attach(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._raw.event_fd())
        self._loop = loop
        loop.add_reader(self._raw.event_fd(), lambda: self._route(self._raw.poll()))

    @staticmethod
    def _consume(out: Completion, ev: _native.Event) -> bool:
        if ev.kind == "token":
            out.tokens.append(ev.token)
            out.pieces.append(ev.piece)
            out.slot = ev.slot
            return False
        if ev.kind == "error":
            raise NativeError(f"request {ev.request_id} failed: {ev.message}")
        out.stop_reason = ev.stop_reason
        out.timings = ev.timings
        out.slot = ev.slot
        return True


def decode_pieces(pieces: list[bytes]) -> str:
    """UTF-8 text of a token sequence's pieces (a character may span several tokens)."""
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    return "".join(dec.decode(p) for p in pieces) + dec.decode(b"", final=True)

"""The Python face of a native engine: routes the core's event stream to its requests.

The core pushes token/progress/done/error events for every request into one queue and signals an eventfd.
This class is that queue's single consumer: an asyncio reader on the eventfd (`stream`), or a
blocking wait for scripts and tests (`generate`); use one style per engine.

If the core's loop dies of an exception (a "fault", native/DESIGN.md), every request ends with an
error event, later calls raise EngineClosedError, and the callbacks given to `on_fault` run once with
the reason. `close` may be called any number of times, from any thread.
"""

from __future__ import annotations

import asyncio
import codecs
import threading
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

from . import _native
from .errors import EngineClosedError, NativeError


@dataclass
class Completion:
    """A finished request: sampled tokens, their text, why it stopped, and its timings.

    With `RequestParams.n_probs > 0`, `logprobs[i]` and `top_logprobs[i]` belong to `tokens[i]`
    (as on its token event); otherwise both stay empty.
    """

    request_id: int
    tokens: list[int] = field(default_factory=list)
    pieces: list[bytes] = field(default_factory=list)
    stop_reason: str = ""
    timings: _native.Timings | None = None
    slot: int = -1
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return decode_pieces(self.pieces)


# Events after which a request's stream goes on; any other kind is its last.
_ONGOING = frozenset({"token", "progress"})


class _Sink:
    __slots__ = ("events", "done", "wake")

    def __init__(self) -> None:
        self.events: deque[_native.Event] = deque()
        self.done = False
        self.wake: asyncio.Event | None = None


class Engine:
    """One model, N slots. See native/_native.pyi for the operations it forwards."""

    def __init__(
        self, config: _native.EngineConfig, on_load_progress: Callable[[float], None] | None = None
    ) -> None:
        self._raw = _native.Engine(config, on_load_progress)
        self._sinks: dict[int, _Sink] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # Guards _closed and _loop: close() may come from any thread while the event loop attaches.
        self._lock = threading.Lock()
        self._closed = False
        self._drained = False  # close() has routed the core's last events: nothing more will come
        self._fault = ""
        self._fault_callbacks: list[Callable[[str], None]] = []

    # -- plain forwards -------------------------------------------------------------------------
    @property
    def raw(self) -> _native.Engine:
        return self._raw

    @property
    def model(self) -> _native.ModelInfo:
        return self._raw.model

    @property
    def config(self) -> _native.EngineConfig:
        """A copy of the engine's configuration (read-only; the running engine never changes)."""
        return self._raw.config

    @property
    def closed(self) -> bool:
        """True once close() was called or the core's loop faulted."""
        return self._closed or self._raw.closed

    @property
    def fault(self) -> str:
        """Why the core's loop died ('' while it is healthy, or after a plain close())."""
        return self._raw.fault

    @property
    def n_ctx_slot(self) -> int:
        return self._raw.n_ctx_slot

    @property
    def kv_streams(self) -> bool:
        return self._raw.kv_streams

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self._raw.tokenize(text, add_special, parse_special)

    def detokenize(
        self, tokens: list[int], remove_special: bool = False, unparse_special: bool = True
    ) -> str:
        # A token may end inside a UTF-8 sequence: replaced, as llama-server answers (U+FFFD).
        return self._raw.detokenize(tokens, remove_special, unparse_special).decode("utf-8", "replace")

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

    def snapshot_slot(self, slot: int) -> _native.SlotSnapshot:
        return self._raw.snapshot_slot(slot)

    def write_snapshot(
        self, snapshot: _native.SlotSnapshot, path: str, durable: bool = True
    ) -> _native.SlotFileInfo:
        return self._raw.write_snapshot(snapshot, path, durable)

    def restore_slot(self, slot: int, path: str) -> _native.SlotFileInfo:
        return self._raw.restore_slot(slot, path)

    def erase_slot(self, slot: int) -> int:
        return self._raw.erase_slot(slot)

    def cancel(self, request_id: int) -> bool:
        return self._raw.cancel(request_id)

    def close(self) -> None:
        """Stop the core; requests in flight end with their error event, streams included.

        Idempotent and thread-safe: every call returns once the core's loop has stopped; the first
        one also detaches the asyncio reader, on the event loop's own thread (asyncio objects are
        not thread-safe), so from another thread that part is scheduled rather than done.
        """
        with self._lock:
            first = not self._closed
            self._closed = True
            loop, self._loop = self._loop, None
        self._raw.close()  # the core's close is idempotent and thread-safe; GIL released
        if not first:
            return
        if loop is None or loop.is_closed():
            self._finish_close(None)
            return
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._finish_close(loop)
            return
        try:
            loop.call_soon_threadsafe(self._finish_close, loop)
        except RuntimeError:  # the loop closed meanwhile: nobody is left to wake
            self._finish_close(None)

    def _finish_close(self, loop: asyncio.AbstractEventLoop | None) -> None:
        # The shutdown errors are routed before the reader goes away, then every stream is woken
        # (each ends with its error event, or EngineClosedError).
        self._route(self._raw.poll())
        self._drained = True
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._raw.event_fd())
        for sink in list(self._sinks.values()):
            if sink.wake is not None:
                sink.wake.set()

    def on_fault(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` once if the core's loop dies; call from inside the event loop.

        Attaches the eventfd reader to the running loop now, so the fault is seen even while no
        stream is open; the callback then runs on the event loop (in a blocking `generate`, on its
        thread). Registered after the fault was seen, it is called soon.
        """
        loop = asyncio.get_running_loop()
        self._fault_callbacks.append(callback)
        if self._fault:
            loop.call_soon(callback, self._fault)
            return
        self._attach()

    # -- requests -------------------------------------------------------------------------------
    def submit(self, slot: int, params: _native.RequestParams) -> int:
        request_id = self._raw.submit(slot, params)
        self._sinks[request_id] = _Sink()
        return request_id

    def _route(self, events: list[_native.Event]) -> None:
        for ev in events:
            if ev.kind == "fault":  # engine-level (request_id -1), after every request's error
                self._on_fault_event(ev.message)
                continue
            sink = self._sinks.get(ev.request_id)
            if sink is None:
                continue
            sink.events.append(ev)
            if ev.kind not in _ONGOING:
                sink.done = True
            if sink.wake is not None:
                sink.wake.set()

    def _on_fault_event(self, reason: str) -> None:
        if self._fault:
            return
        self._fault = reason or "unknown"
        for callback in list(self._fault_callbacks):
            callback(self._fault)

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
                    finished = ev.kind not in _ONGOING
                    yield ev
                    if finished:
                        return
                if self._drained:  # not just _closed: its error event may still be on its way
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
        with self._lock:
            # Checked under the lock close() takes: a reader added after close() had taken _loop
            # would never be removed.
            if self._closed:
                raise EngineClosedError("the engine was closed")
            previous, self._loop = self._loop, loop
            if previous is loop:
                return
            if previous is not None and not previous.is_closed():
                previous.remove_reader(self._raw.event_fd())
            loop.add_reader(self._raw.event_fd(), lambda: self._route(self._raw.poll()))

    @staticmethod
    def _consume(out: Completion, ev: _native.Event) -> bool:
        if ev.kind == "progress":
            return False
        if ev.kind == "token":
            out.tokens.append(ev.token)
            out.pieces.append(ev.piece)
            out.slot = ev.slot
            top = ev.top_logprobs
            if top:  # n_probs > 0: every token event carries at least one entry
                out.logprobs.append(ev.logprob)
                out.top_logprobs.append(top)
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

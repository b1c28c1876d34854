"""A deadline on request headers, for servers that face clients we do not trust (the gateway).

uvicorn bounds the size of a request's headers (h11's incomplete-event limit, 16 KiB) and how long
an idle keep-alive connection stays open, but not how long a client may take to *send* its headers:
one byte every few seconds holds a connection (and its task) open forever — the slowloris attack.
`header_deadline(seconds)` is uvicorn's HTTP protocol (httptools' C parser when installed, else h11)
with a timer armed when a connection opens and started again by the first byte of every later
request; unless a complete request head arrived by then, the connection gets `408 Request Timeout`
and is closed. The head's size is bounded here too (16 KiB, h11's limit; httptools has none):
more gets `431` and the connection closed. Bodies are bounded separately
(`engine_pool.http.body.read_body`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # the C parser: several times less CPU per request than h11 (uvicorn's own "auto" choice)
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Base
except ImportError:  # pragma: no cover - httptools is a dependency; kept for source checkouts without it
    _Base = H11Protocol  # type: ignore[assignment,misc]

log = structlog.get_logger("slotkeeper.http")
_TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_TOO_LARGE_RESPONSE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
)
MAX_HEAD_BYTES = 16 * 1024


def header_deadline(seconds: float, base: type[Any] = _Base) -> type[Any]:
    """uvicorn's HTTP protocol class (`base`), closing connections whose request head takes over
    `seconds` or `MAX_HEAD_BYTES`.

    The clock starts when a connection opens and when the first byte of each further request
    arrives, never while a keep-alive connection merely waits (uvicorn's keep-alive timeout governs
    that, and a 408 written into an idle connection would be read as the answer to the client's next
    request)."""

    class HeaderDeadlineProtocol(base):  # type: ignore[valid-type,misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._deadline: asyncio.TimerHandle | None = None
            self._waiting_after: object | None = None  # the cycle that was current when the clock started
            self._partial = False  # bytes of a request head arrived since the clock started
            self._head_bytes = 0  # bytes of an incomplete request head since the clock started

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            self._waiting_after, self._partial, self._head_bytes = self.cycle, False, 0
            self._deadline = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if (
                self.cycle is self._waiting_after
                and self._between_requests()
                and not self.transport.is_closing()
            ):
                log.warning(
                    "http.header_timeout", client=str(self.client), seconds=seconds, partial=self._partial
                )
                if self._partial:
                    self.transport.write(_TIMEOUT_RESPONSE)
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()  # a new connection owes us a request head

        def data_received(self, data: bytes) -> None:
            if self._deadline is None and self._between_requests():
                self._arm()  # the first byte of the next request: its head is on the clock
            self._partial = True
            super().data_received(data)
            if self._deadline is None:
                return
            if self.cycle is not self._waiting_after:
                self._disarm()  # a complete request head arrived: a new request cycle started
                return
            self._head_bytes += len(data)  # all of it still the head: no request started yet
            if self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                log.warning("http.head_too_large", client=str(self.client), bytes=self._head_bytes)
                self._disarm()
                self.transport.write(_TOO_LARGE_RESPONSE)
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderDeadlineProtocol

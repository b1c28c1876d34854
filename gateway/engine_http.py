"""The gateway's HTTP/1.1 client for engines: keep-alive connections driven by asyncio protocols,
answers parsed by httptools (llhttp, the C parser uvicorn serves with).

The gateway's added latency is mostly its own CPU per request, and a general-purpose client spends
much of it on what an engine call does not need (cookies, redirects, proxies, tracing hooks, stream
readers); this client spends a fraction of a general one's CPU on the same call (figures:
docs/benchmarks.md, "Figures formerly in code comments"). It does only what the gateway asks of
engines on the cluster network: a POST of a body it encoded, an answer with a Content-Length,
chunked, or ending with the connection, read whole or piece by piece as it arrives (a stream is
relayed without buffering).

- **Connections**: per host and port, the most recently used idle one first, opened within
  ``connect_timeout_s`` (else :class:`EngineDown`). A connection goes back to the pool only after
  a complete answer the engine lets it keep alive; an answer left early (the client went away)
  closes it, which is how the engine learns to stop generating.
- **Timeouts**: the answer's head and every later piece must arrive within ``read_timeout_s`` of
  the previous one (a stream may last long; a silent engine may not): :class:`EngineTimeout`. A
  host the network cut off is noticed by TCP itself (`watch_peer`) well before that.
- **Failures**: refused or broken connections and malformed answers are :class:`EngineDown`; a
  request sent on a pooled connection that the engine had closed meanwhile (its keep-alive timeout
  racing our reuse) is sent once more on a new connection, but only when not one byte of an answer
  came back.
"""

from __future__ import annotations

import asyncio
import collections
import socket
from collections.abc import AsyncGenerator, Mapping
from urllib.parse import urlsplit

import httptools


class EngineHttpError(Exception):
    """The engine could not be asked or its answer could not be read."""


class EngineDown(EngineHttpError):
    """Refused, reset, closed or never made connection (or one TCP gave up on: `watch_peer`), or
    an answer that is not HTTP."""


class EngineTimeout(EngineHttpError, TimeoutError):
    """The answer's head or its next piece did not arrive within the read timeout."""


_MAX_HEAD = 64 * 1024  # an engine's answer head is a few hundred bytes
# A peer cut off by the network (a partition, a host gone without a reset) is given up on after
# this long without an answer to TCP's keepalive probes or an acknowledgement of what was sent: an
# engine that computes for minutes still acknowledges at the TCP level.
PEER_SILENCE_S = 11


def watch_peer(sock: socket.socket, silence_s: int = PEER_SILENCE_S) -> None:
    """TCP keepalive (probes after 5 s idle, every 2 s) and a user timeout on ``sock``: a silent
    peer breaks the connection within ``silence_s`` instead of the kernel's quarter of an hour."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval = 5, 2
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, (silence_s - idle) // interval))
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, silence_s * 1000)


def _header_lines(headers: Mapping[str, str]) -> bytes:
    """Header lines of the gateway's own making (no tenant text: names and values are ours)."""
    return "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode("latin-1")


class _Connection(asyncio.Protocol):
    """One keep-alive connection: one request at a time, its answer parsed as it arrives."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_done = False
        self.complete = False
        self.keep_alive = False  # the answer lets the connection serve another request
        self.received = False  # any byte of this answer
        self.pieces: collections.deque[bytes] = collections.deque()
        self.error: EngineHttpError | None = None
        self._head_bytes = 0

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's are not asyncio.Transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            watch_peer(sock)

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(EngineDown(f"the engine's answer is not valid HTTP ({exc})"))
        self._wake()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.error is None and self.head_done and not self.complete and self._delimited_by_close():
            self.complete = True
        elif not self.complete and self.error is None:
            self.error = EngineDown("the engine closed the connection" + (f" ({exc})" if exc else ""))
        self._wake()

    # -- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > _MAX_HEAD:
            raise EngineDown("the engine's answer head is too large")
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.pieces.append(body)

    def on_message_complete(self) -> None:
        self.keep_alive = self._parser.should_keep_alive()  # (the parser forgets it right after)
        self.complete = True

    # -- the client's side
    def _delimited_by_close(self) -> bool:
        chunked = "chunked" in self.headers.get("transfer-encoding", "")
        return "content-length" not in self.headers and not chunked

    def _fail(self, error: EngineHttpError) -> None:
        self.error = error
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def send(self, data: bytes) -> None:
        """Write a request; :class:`EngineDown` when the connection is closing — the engine closed it
        and the loop has not said so yet (uvloop raises on a write then; asyncio would write into
        a socket about to go)."""
        self._reset()
        if self.transport is None or self.transport.is_closing():
            raise EngineDown("the connection is closing")
        try:
            self.transport.write(data)
        except RuntimeError as exc:  # (uvloop: its handle was closed meanwhile)
            raise EngineDown(f"the connection closed ({exc})") from None

    async def wait(self, timeout_s: float) -> None:
        """Until more of the answer arrived, it ended, or it failed (raised)."""
        if self.error is not None:
            raise self.error
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = loop.call_later(timeout_s, self._expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
        if self.error is not None:
            raise self.error

    def _expire(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            waiter.set_exception(EngineTimeout("the engine sent nothing in time"))

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed and self.error is None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class EngineResponse:
    """An answer whose head arrived; read its body once, then it goes back (or is closed)."""

    def __init__(self, client: EngineHttp, key: tuple[str, int], conn: _Connection, timeout_s: float) -> None:
        self._client, self._key, self._conn, self._timeout_s = client, key, conn, timeout_s
        self.status = conn.status
        self.headers: Mapping[str, str] = conn.headers
        self._done = False

    async def read(self) -> bytes:
        """The whole body; the connection goes back to the pool."""
        return b"".join([piece async for piece in self.iter_any()])

    async def iter_any(self) -> AsyncGenerator[bytes, None]:
        """The body as it arrives. Leaving before its end closes the connection."""
        conn = self._conn
        try:
            while True:
                while conn.pieces:
                    yield conn.pieces.popleft()
                if conn.error is not None:  # (what arrived before it was passed on first)
                    raise conn.error
                if conn.complete:
                    break
                await conn.wait(self._timeout_s)
        finally:
            if conn.complete and not conn.pieces:
                self.release()
            else:
                self.close()

    def release(self) -> None:
        """Back to the pool when the answer was read to its end, else closed."""
        if self._done:
            return
        self._done = True
        if self._conn.reusable() and not self._conn.pieces:
            self._client._give_back(self._key, self._conn)
        else:
            self._conn.close()

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._conn.close()


class EngineHttp:
    """Keep-alive connections to engines (see the module doc). One per gateway; ``aclose`` at
    shutdown. ``headers`` go with every request (the internal credential)."""

    def __init__(
        self,
        headers: Mapping[str, str] | None = None,
        *,
        read_timeout_s: float,
        connect_timeout_s: float = 5.0,
        max_idle_per_host: int = 64,
    ) -> None:
        self._headers = _header_lines(headers or {})
        self.read_timeout_s = read_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._max_idle = max_idle_per_host
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._targets: dict[str, tuple[tuple[str, int], bytes]] = {}  # url -> (host, port), head start
        self._closed = False

    async def __aenter__(self) -> EngineHttp:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _target(self, url: str) -> tuple[tuple[str, int], bytes]:
        known = self._targets.get(url)
        if known is None:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise EngineDown(f"not an http:// URL: {url!r}")
            port = parts.port or 80
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
            head = f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\n".encode("latin-1") + self._headers
            known = ((parts.hostname, port), head)
            if len(self._targets) < 4096:  # engine URLs: a handful per engine
                self._targets[url] = known
        return known

    async def post(
        self,
        url: str,
        body: bytes,
        *,
        content_type: str = "application/json",
        timeout_s: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> EngineResponse:
        """Send ``body`` and wait for the answer's head (its body is read from the response);
        ``headers`` go with this request only."""
        if self._closed:
            raise EngineDown("the gateway is shutting down")
        key, head = self._target(url)
        timeout = self.read_timeout_s if timeout_s is None else timeout_s
        extra = _header_lines(headers) if headers else b""
        request = b"".join(
            [
                head,
                extra,
                b"content-type: ",
                content_type.encode("latin-1"),
                b"\r\ncontent-length: ",
                str(len(body)).encode(),
                b"\r\n\r\n",
                body,
            ]
        )
        while True:
            conn, reused = self._take(key), True
            if conn is None:
                conn, reused = await self._open(key), False
            try:
                conn.send(request)
                while not conn.head_done:
                    await conn.wait(timeout)
            except EngineDown:
                conn.close()
                if reused and not conn.received:  # a pooled connection the engine had closed
                    continue
                raise
            except BaseException:  # timed out or cancelled: the request is in flight, never reuse it
                conn.close()
                raise
            return EngineResponse(self, key, conn, timeout)

    def _take(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
            conn.close()
        return None

    async def _open(self, key: tuple[str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            opening = loop.create_connection(_Connection, *key)
            _, conn = await asyncio.wait_for(opening, self.connect_timeout_s)
        except TimeoutError as exc:  # a host the network lost: unreachable, as a refusal is
            raise EngineDown(f"could not connect to {key[0]}:{key[1]} in time") from exc
        except OSError as exc:
            raise EngineDown(f"could not connect to {key[0]}:{key[1]} ({exc.strerror or exc})") from exc
        return conn

    def _give_back(self, key: tuple[str, int], conn: _Connection) -> None:
        idle = self._idle.setdefault(key, [])
        if self._closed or len(idle) >= self._max_idle:
            conn.close()
        else:
            idle.append(conn)

    def idle_connections(self) -> int:
        return sum(1 for conns in self._idle.values() for c in conns if not c.closed)

    async def aclose(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

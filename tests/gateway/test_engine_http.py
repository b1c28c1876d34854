"""gateway.engine_http against a raw asyncio server that sends exactly the bytes each case needs, on
asyncio's event loop and on uvloop's (the gateway's, whose transports are its own classes)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvloop

from gateway.engine_http import EngineDown, EngineHttp, EngineTimeout, watch_peer

Handler = Callable[[int, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class Server:
    url: str
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # a connection ended


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request (head and Content-Length body); b'' when the client closed."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return b""
    lines = head.lower().split(b"\r\n")
    length = next((int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length")), 0)
    return head + await reader.readexactly(length)


def answer(body: bytes, *extra: str) -> bytes:
    head = "".join(f"{h}\r\n" for h in extra)
    return f"HTTP/1.1 200 OK\r\ncontent-length: {len(body)}\r\n{head}\r\n".encode() + body


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[Server]:
    server_state = Server("")

    handlers: set[asyncio.Task[None]] = set()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        server_state.connections += 1
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            await handler(server_state.connections, reader, writer)
        finally:
            writer.close()
            server_state.closed.set()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    server_state.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
    async with server:
        yield server_state
        if handlers:  # each ends when its client closed (the client's `async with` closed first)
            await asyncio.wait(handlers, timeout=5)


async def test_keep_alive_reuses_one_connection_and_sends_the_credential() -> None:
    seen: list[bytes] = []

    async def echo(_: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while request := await read_request(reader):
            seen.append(request)
            writer.write(answer(request.split(b"\r\n\r\n", 1)[1]))

    async with serving(echo) as srv, EngineHttp({"authorization": "Bearer k"}, read_timeout_s=5) as client:
        for i in range(3):
            resp = await client.post(srv.url, b'{"n": %d}' % i)
            assert resp.status == 200 and await resp.read() == b'{"n": %d}' % i
        assert srv.connections == 1 and client.idle_connections() == 1
    head = seen[0].split(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"post /v1/chat/completions http/1.1\r\n")
    assert b"authorization: bearer k" in head and b"host: 127.0.0.1:" in head
    assert b"content-type: application/json" in head and b"content-length: 8" in head


async def test_a_chunked_stream_arrives_piece_by_piece() -> None:
    go_on = asyncio.Event()

    async def stream(_: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n")
        writer.write(b"content-type: text/event-stream\r\n\r\n")
        writer.write(b"6\r\ndata: \r\n")
        await writer.drain()
        await go_on.wait()  # the second piece only after the client saw the first
        writer.write(b"4\r\none\n\r\n0\r\n\r\n")
        await read_request(reader)  # keeps the connection until the client goes

    async with serving(stream) as srv, EngineHttp(read_timeout_s=5) as client:
        resp = await client.post(srv.url, b"{}")
        assert resp.headers["content-type"] == "text/event-stream"
        got = []
        async for piece in resp.iter_any():
            got.append(piece)
            go_on.set()
        assert b"".join(got) == b"data: one\n" and got[0] == b"data: "
        assert client.idle_connections() == 1  # read to its end: back in the pool


async def test_leaving_a_stream_early_closes_its_connection() -> None:
    async def endless(_: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await reader.read()  # until the client closes

    async with serving(endless) as srv, EngineHttp(read_timeout_s=5) as client:
        resp = await client.post(srv.url, b"{}")
        pieces = resp.iter_any()
        assert await pieces.__anext__() == b"hello"
        await pieces.aclose()
        await asyncio.wait_for(srv.closed.wait(), 5)  # the engine learns the client went away
        assert client.idle_connections() == 0


async def test_a_body_ended_by_the_connection_is_read_whole_and_not_reused() -> None:
    async def close_delimited(_: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")

    async with serving(close_delimited) as srv, EngineHttp(read_timeout_s=5) as client:
        resp = await client.post(srv.url, b"{}")
        assert await resp.read() == b"all of it"
        assert client.idle_connections() == 0
        resp = await client.post(srv.url, b"{}")
        assert await resp.read() == b"all of it" and srv.connections == 2


async def test_a_silent_engine_times_out_and_its_connection_is_closed() -> None:
    async def silent(_: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()

    async with serving(silent) as srv, EngineHttp(read_timeout_s=0.2) as client:
        with pytest.raises(EngineTimeout):
            await client.post(srv.url, b"{}")
        await asyncio.wait_for(srv.closed.wait(), 5)


async def test_a_stream_that_stalls_times_out_between_pieces() -> None:
    async def stalls(_: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n")
        await reader.read()

    async with serving(stalls) as srv, EngineHttp(read_timeout_s=0.2) as client:
        resp = await client.post(srv.url, b"{}")
        with pytest.raises(EngineTimeout):
            await resp.read()
        await asyncio.wait_for(srv.closed.wait(), 5)


async def test_a_host_that_never_answers_the_connect_is_engine_down() -> None:
    with socket.socket() as listener:  # a backlog of 0, filled: the next SYN is never answered
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/x"
        fillers = []
        for _ in range(4):  # until the queue is full: a connect that is not answered
            filler = socket.socket()
            filler.settimeout(0.3)
            fillers.append(filler)
            try:
                filler.connect(listener.getsockname())
            except TimeoutError:
                break
        try:
            async with EngineHttp(read_timeout_s=5, connect_timeout_s=0.3) as client:
                with pytest.raises(EngineDown, match="could not connect"):
                    await client.post(url, b"{}")
        finally:
            for f in fillers:
                f.close()


def test_connections_give_up_on_a_silent_peer_within_seconds() -> None:
    with socket.socket() as sock:
        watch_peer(sock, silence_s=11)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        idle = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
        every = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)
        probes = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)
        assert idle + every * probes <= 11
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 11_000


async def test_refused_broken_and_garbled_answers_are_engine_down() -> None:
    async with serving(lambda *_: asyncio.sleep(0)) as srv:
        url = srv.url
    async with EngineHttp(read_timeout_s=5) as client:
        with pytest.raises(EngineDown, match="could not connect"):
            await client.post(url, b"{}")  # the server is gone: refused

    async def short(_: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten b")

    async with serving(short) as srv, EngineHttp(read_timeout_s=5) as client:
        resp = await client.post(srv.url, b"{}")
        with pytest.raises(EngineDown, match="closed"):
            await resp.read()

    async def garbled(_: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SMTP ready\r\n\r\n")
        await reader.read()

    async with serving(garbled) as srv, EngineHttp(read_timeout_s=5) as client:
        with pytest.raises(EngineDown, match="not valid HTTP"):
            await client.post(srv.url, b"{}")

    async def huge_head(_: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n" + b"x-pad: " + b"a" * 70_000 + b"\r\n\r\n")
        await reader.read()

    async with serving(huge_head) as srv, EngineHttp(read_timeout_s=5) as client:
        with pytest.raises(EngineDown):
            await client.post(srv.url, b"{}")


async def test_a_pooled_connection_the_engine_dropped_is_replaced_before_any_answer() -> None:
    async def drops_reuse(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer(b"first" if n == 1 else b"fresh"))
        if n == 1:  # keep-alive on paper; the next request on it finds it closed without an answer
            await read_request(reader)
            return
        await read_request(reader)

    async with serving(drops_reuse) as srv, EngineHttp(read_timeout_s=5) as client:
        assert await (await client.post(srv.url, b"{}")).read() == b"first"
        assert await (await client.post(srv.url, b"{}")).read() == b"fresh"
        assert srv.connections == 2


class _ClosedHandle:
    """A transport as uvloop leaves it when the engine's reset closed its handle and the protocol
    has not been told yet: not closing on paper, and a write raises RuntimeError."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

    def close(self) -> None:
        self.real.close()


async def test_a_connection_closed_before_the_loop_said_so_is_replaced() -> None:
    """An engine killed (SIGKILL) resets its connections: the loop closes them at once and tells
    their protocols a turn later. A request in that window takes another connection — one that was
    written to used to raise RuntimeError, which answered the tenant 500."""

    async def answers(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader):
            writer.write(answer(b"ok %d" % n))

    async with serving(answers) as srv, EngineHttp(read_timeout_s=5) as client:
        for n, breaks in enumerate(("abort", "handle"), start=1):
            assert await (await client.post(srv.url, b"{}")).read() == b"ok %d" % n
            (pooled,) = [c for conns in client._idle.values() for c in conns]
            assert pooled.transport is not None
            if breaks == "abort":
                pooled.transport.abort()  # closing: connection_lost comes later
            else:
                pooled.transport = _ClosedHandle(pooled.transport)  # type: ignore[assignment]
            assert await (await client.post(srv.url, b"{}")).read() == b"ok %d" % (n + 1)
        assert srv.connections == 3


async def test_an_answer_that_already_began_is_never_sent_again() -> None:
    async def breaks_mid_answer(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer(b"ok"))
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-")  # then the connection drops

    async with serving(breaks_mid_answer) as srv, EngineHttp(read_timeout_s=5) as client:
        assert await (await client.post(srv.url, b"{}")).read() == b"ok"
        with pytest.raises(EngineDown):
            await client.post(srv.url, b"{}")
        assert srv.connections == 1


def test_only_http_urls() -> None:
    client = EngineHttp(read_timeout_s=1)
    with pytest.raises(EngineDown):
        asyncio.run(client.post("https://engine/x", b"{}"))


def test_on_uvloop_the_gateways_loop() -> None:
    """The cases above ran on asyncio's loop; the gateway runs on uvloop (its own transports)."""

    async def cases() -> None:
        await test_keep_alive_reuses_one_connection_and_sends_the_credential()
        await test_a_chunked_stream_arrives_piece_by_piece()
        await test_leaving_a_stream_early_closes_its_connection()
        await test_a_silent_engine_times_out_and_its_connection_is_closed()
        await test_a_pooled_connection_the_engine_dropped_is_replaced_before_any_answer()
        await test_a_connection_closed_before_the_loop_said_so_is_replaced()
        await test_refused_broken_and_garbled_answers_are_engine_down()

    uvloop.run(cases())


async def test_concurrent_requests_each_get_a_connection_and_all_come_back() -> None:
    release = asyncio.Event()
    arrived = 0

    async def slow_echo(_: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal arrived
        while request := await read_request(reader):
            arrived += 1
            if arrived >= 8:
                release.set()
            await release.wait()  # every request is in flight at once
            writer.write(answer(request.split(b"\r\n\r\n", 1)[1]))

    async with serving(slow_echo) as srv, EngineHttp(read_timeout_s=5) as client:

        async def one(i: int) -> bytes:
            return await (await client.post(srv.url, b"%d" % i)).read()

        assert await asyncio.gather(*(one(i) for i in range(8))) == [b"%d" % i for i in range(8)]
        assert srv.connections == 8 and client.idle_connections() == 8
        assert await one(99) == b"99" and srv.connections == 8  # reused
        await client.aclose()
        assert client.idle_connections() == 0
        with pytest.raises(EngineDown):
            await client.post(srv.url, b"{}")  # closed: refuses new requests

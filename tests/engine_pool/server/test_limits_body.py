"""Request bodies at the engine's edge: 413 for a large body (never kept), 408 for a trickled one, 400
for deep JSON — over raw sockets where what the client sends must be exactly what the test says."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterable
from typing import Any

import httpx

from ..conftest import EngineProcess

LIMIT = 4 << 20  # the limited engine's --max-body-bytes 4M
DEADLINE_S = 30.0  # a response that takes this long is a failure, not a slow pass


def _connect(eng: EngineProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", eng.port), timeout=DEADLINE_S)
    return sock


def _head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: engine", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _read_response(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    """Status and JSON body of one response (waits up to DEADLINE_S)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = next(
        int(v) for k, _, v in (ln.partition(": ") for ln in lines[1:]) if k.lower() == "content-length"
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside the response body"
        body += chunk
    return status, json.loads(body[:length])


def _chunked(parts: Iterable[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)


def test_a_body_over_the_limit_is_413(limited: httpx.Client) -> None:
    def chunks() -> Iterable[bytes]:  # a generator: sent chunked, without Content-Length
        for _ in range(16):
            yield b" " * (LIMIT // 16)
        yield b"{"

    for content in (b" " * (LIMIT + 1), chunks()):
        # The engine reads the body to its end without keeping it, so the client gets the 413
        # rather than a connection reset while it is still sending.
        r = limited.post("/completion", content=content)
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert (err["type"], err["code"], err["limit"]) == (
            "invalid_request_error",
            "payload_too_large",
            LIMIT,
        )
        assert err["message"] == f"the request body has {LIMIT + 1} bytes or more; the limit is {LIMIT}"


def test_a_content_length_over_the_limit_is_413_even_if_the_body_never_comes(
    limited_engine: EngineProcess,
) -> None:
    with _connect(limited_engine) as sock:
        sock.sendall(_head("/completion", {"Content-Length": str(LIMIT + 1)}))  # and nothing else
        status, body = _read_response(sock)  # after --body-timeout-s, not never
    assert status == 413, body
    assert body["error"]["message"] == f"the request body has {LIMIT + 1} bytes or more; the limit is {LIMIT}"


def test_a_chunked_body_over_the_limit_that_never_ends_is_413(limited_engine: EngineProcess) -> None:
    piece = b" " * (256 << 10)
    with _connect(limited_engine) as sock:
        sock.sendall(_head("/v1/chat/completions", {"Transfer-Encoding": "chunked"}))
        # One byte more than the limit, never terminated: the engine counts what arrives.
        sock.sendall(_chunked([piece] * (LIMIT // len(piece)) + [b"{"]))
        status, body = _read_response(sock)
    assert status == 413, body
    assert body["error"]["message"] == f"the request body has {LIMIT + 1} bytes or more; the limit is {LIMIT}"


def test_chunked_body_within_the_limit_is_read(limited: httpx.Client) -> None:
    def parts() -> Iterable[bytes]:
        yield b'{"content": '
        yield b'"hello"}'

    r = limited.post("/tokenize", content=parts())  # a generator: chunked, no Content-Length
    assert r.status_code == 200, r.text
    assert r.json()["tokens"]


def test_a_trickled_body_gets_408(limited_engine: EngineProcess) -> None:
    stop = threading.Event()
    with _connect(limited_engine) as sock:
        sock.sendall(_head("/completion", {"Content-Length": "1000"}))

        def trickle() -> None:
            # One byte every 100 ms: the 1000 promised bytes would take 100 s; the limit is 1 s.
            try:
                while not stop.wait(0.1):
                    sock.sendall(b" ")
            except OSError:
                pass  # the engine answered and closed the connection

        sender = threading.Thread(target=trickle)
        sender.start()
        try:
            status, body = _read_response(sock)
        finally:
            stop.set()
            sender.join()
    assert status == 408, body
    err = body["error"]
    assert (err["type"], err["code"]) == ("invalid_request_error", "request_timeout")
    assert "did not arrive within 1 s" in err["message"]


def test_json_deeper_than_the_limit_is_400(limited: httpx.Client, llama: httpx.Client) -> None:
    def nested(depth: int) -> bytes:  # `prompt` holds depth - 1 levels: the body object is one
        return b'{"prompt": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"

    r = limited.post("/completion", content=nested(17))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "the request body nests JSON deeper than 16 levels"
    # At the limit the body parses, and the next complaint is about the prompt itself.
    r = limited.post("/completion", content=nested(16))
    assert r.status_code == 400 and "'prompt' must be" in r.json()["error"]["message"], r.text
    # Far deeper than Python's recursion limit (the engine's defaults): a 400, never a 500.
    for body in (b"[" * 100_000 + b"]" * 100_000, nested(100_000)):
        r = llama.post("/completion", content=body)
        assert r.status_code == 400, r.text[:200]
        assert r.json()["error"]["message"] == "the request body nests JSON deeper than 64 levels"


def test_slot_actions_read_bodies_within_the_limits(limited_engine: EngineProcess) -> None:
    with _connect(limited_engine) as sock:
        sock.sendall(_head("/slots/0?action=save", {"Content-Length": str(LIMIT + 1)}))
        status, body = _read_response(sock)
    assert status == 413, body


def test_the_engine_still_serves_after_the_refusals(
    limited: httpx.Client, limited_engine: EngineProcess
) -> None:
    assert limited_engine.proc is not None and limited_engine.proc.poll() is None
    r = limited.post("/completion", json={"prompt": "Hello world", "n_predict": 2})
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 2

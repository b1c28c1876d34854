"""Response header names in llama-server's case (`Access-Control-Allow-Origin`, not
`access-control-allow-origin`).

HTTP header names are case-insensitive, but clients that compare them case-sensitively exist
(llama-server's own test suite is one: it reads `Process-Start-Time-Unix` and the CORS headers from
a plain dict). uvicorn's httptools protocol lower-cases every name it writes, whatever the app
sends, so the case is restored where the bytes leave: each request cycle's transport gets a thin
wrapper that rewrites the names in its response head (`canonical_head`) and passes everything else
through untouched — bodies and SSE chunks are never looked at.

The canonical form is llama-server's (cpp-httplib writes names as the server code spells them):
each dash-separated word capitalised (`Content-Type`, `X-Session-Id`), plus the spellings in
`_SPELLED`.
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_SPELLED = {b"www-authenticate": b"WWW-Authenticate", b"etag": b"ETag"}
_CONTINUE = b"HTTP/1.1 100 "


def canonical_name(name: bytes) -> bytes:
    """`x-session-id` -> `X-Session-Id`. Pure."""
    return _SPELLED.get(name.lower()) or b"-".join(w[:1].upper() + w[1:] for w in name.split(b"-"))


def canonical_head(head: bytes) -> bytes:
    """A response head (status line, header lines, blank line; maybe followed by a body, as in
    uvicorn's own error answers) with every header name in canonical case. Pure."""
    end = head.find(b"\r\n\r\n")
    if end < 0:
        return head
    status, *lines = head[:end].split(b"\r\n")
    fixed = [status]
    for line in lines:
        name, sep, value = line.partition(b":")
        fixed.append(canonical_name(name) + sep + value if sep else line)
    return b"\r\n".join(fixed) + head[end:]


class _HeadTransport:
    """A request cycle's transport: its first write that is a final response head (a `100
    Continue` may come first) is written in canonical case; every other call goes to `inner`."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._head_pending = True

    def write(self, data: bytes) -> None:
        if self._head_pending and data.startswith(b"HTTP/"):
            self._head_pending = data.startswith(_CONTINUE)
            data = canonical_head(data)
        self._inner.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class CanonicalHeaderProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol writing response header names in canonical case. Every request
    cycle is made in `on_headers_complete`, before its ASGI task first runs, so its transport is
    wrapped before anything is written."""

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self.cycle is not None and not isinstance(self.cycle.transport, _HeadTransport):
            self.cycle.transport = _HeadTransport(self.cycle.transport)  # type: ignore[assignment]

"""CORS at the edge (engine and gateway), answered as llama-server b11434 answers it.

A page on another origin may call the API only when the response names its origin in
`Access-Control-Allow-Origin`; before a request with a key header it sends a preflight (OPTIONS),
which carries no key. So CORS is the outermost layer, answered before any key check (llama-server's
pre-routing handler). The rules, `allowed_origin` and `cors_headers`, are pure; `CorsMiddleware`
carries them out.

- `*` (llama-server's default): any origin; with credentials (also its default) the request's
  Origin is echoed instead of `*`, so the answer is usable by a credentialed request.
- `localhost`: the Origin is echoed only when its host is localhost, 127.0.0.1 or [::1] over http
  or https (a host that merely starts or ends with "localhost" is another site); otherwise the
  answer names no origin and the browser keeps the page from reading it.
- other values: the origins allowed, echoed when the Origin is one of them. (llama-server sends the
  configured text verbatim, which a browser accepts only when it is a single origin equal to the
  page's: echoing the listed one is the same answer there and makes a list work.)

Every OPTIONS request is a preflight and gets 200 with an empty body, whatever its origin (a
rejected one simply gets no Access-Control-Allow-Origin), plus `Access-Control-Allow-Credentials`
(`true`/`false`), `-Methods` and `-Headers` as configured. A response to an echoed origin carries
`Vary: Origin`, so a shared cache never hands one origin's answer to another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .middleware import HttpMiddleware

DEFAULT_METHODS = "GET, POST, DELETE, OPTIONS"  # llama-server's --cors-methods default
DEFAULT_HEADERS = "*"  # llama-server's --cors-headers default
MIRROR = None  # `CorsPolicy.headers`: allow exactly the headers the preflight asks for
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass(frozen=True)
class CorsPolicy:
    """`--cors-origins` (comma-separated: `*`, `localhost`, origins), `--cors-methods`,
    `--cors-headers` (MIRROR: the preflight's Access-Control-Request-Headers) and
    `--cors-credentials`. The defaults are llama-server's."""

    origins: tuple[str, ...] = ("*",)
    methods: str = DEFAULT_METHODS
    headers: str | None = DEFAULT_HEADERS
    credentials: bool = True


def is_local_origin(origin: str) -> bool:
    """An http(s) origin whose host is this machine's loopback name or address."""
    try:
        parts = urlsplit(origin)
        parts.port  # noqa: B018 - raises ValueError on a malformed port, which is no local origin
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and parts.hostname in LOCAL_HOSTS


def allowed_origin(policy: CorsPolicy, origin: str | None) -> str | None:
    """The Access-Control-Allow-Origin for a request from `origin`; None: the header is left out
    (no Origin: not a browser's cross-origin request; or an origin the policy does not admit)."""
    if not origin:
        return None
    if "*" in policy.origins:
        return origin if policy.credentials else "*"
    if "localhost" in policy.origins and is_local_origin(origin):
        return origin
    listed = origin in policy.origins and origin != "localhost"  # the keyword is no origin
    return origin if listed else None


def _varies(policy: CorsPolicy) -> bool:
    return not ("*" in policy.origins and not policy.credentials)


def cors_headers(
    policy: CorsPolicy, origin: str | None, *, preflight: bool, requested: str = ""
) -> list[tuple[str, str]]:
    """The CORS headers of the answer to a request from `origin`: a preflight's (`requested`: its
    Access-Control-Request-Headers) or any other response's."""
    out: list[tuple[str, str]] = []
    allow = allowed_origin(policy, origin)
    if allow is not None:
        out.append(("Access-Control-Allow-Origin", allow))
        if policy.credentials and not preflight:
            out.append(("Access-Control-Allow-Credentials", "true"))
    if origin and _varies(policy):
        out.append(("Vary", "Origin"))
    if preflight:
        headers = requested if policy.headers is MIRROR else policy.headers
        out.append(("Access-Control-Allow-Credentials", "true" if policy.credentials else "false"))
        out.append(("Access-Control-Allow-Methods", policy.methods))
        if headers:
            out.append(("Access-Control-Allow-Headers", headers))
    return out


def policy_from(origins: Sequence[str], methods: str, headers: str | None, credentials: bool) -> CorsPolicy:
    return CorsPolicy(tuple(origins), methods, headers, credentials)


class CorsMiddleware(HttpMiddleware):
    """ASGI middleware (outermost): answers every OPTIONS request itself, adds the CORS headers to
    every other response. Header names keep llama-server's capitalisation on the wire."""

    def __init__(self, app: ASGIApp, policy: CorsPolicy) -> None:
        super().__init__(app)
        self.policy = policy

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        seen = {k.lower(): v for k, v in scope["headers"]}
        origin = seen.get(b"origin", b"").decode("latin-1") or None
        if scope["method"] == "OPTIONS":
            requested = seen.get(b"access-control-request-headers", b"").decode("latin-1")
            extra = cors_headers(self.policy, origin, preflight=True, requested=requested)
            headers = [(b"Content-Type", b"text/html"), (b"Content-Length", b"0"), *_encode(extra)]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return
        added = _encode(cors_headers(self.policy, origin, preflight=False))
        if not added:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                # Ours replace any the app set (a proxied answer's, say): one policy per response.
                kept = [
                    (k, v)
                    for k, v in message.get("headers", [])
                    if not k.lower().startswith(b"access-control-")
                ]
                message = {**message, "headers": [*kept, *added]}
            await send(message)

        await self.app(scope, receive, send_with_cors)


def _encode(headers: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]

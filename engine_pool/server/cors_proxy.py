"""`/cors-proxy?url=URL`: llama-server's experimental proxy for its web UI's MCP client
(`--ui-mcp-proxy`; without it every call is refused with 403 `feature_disabled`).

GET and POST are forwarded to URL (http or https, no credentials in it, redirects followed) and
the answer streams back with its status and headers, less hop-by-hop, Set-Cookie and CORS ones
(the engine's own CORS layer answers for this origin). The security rule, llama-server's:
nothing the caller sent is forwarded implicitly. Only headers named
`x-llama-server-proxy-header-NAME` are, as `NAME` — so the caller's Authorization (its key for
this engine), X-Api-Key, Cookie and Proxy-Authorization never reach the target. The endpoint
sits behind the API key like every non-public path.
"""

from __future__ import annotations

from collections.abc import Iterable
from http.cookiejar import CookieJar, DefaultCookiePolicy
from urllib.parse import urlsplit

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from engine_pool.errors import BadRequest, Forbidden, ServerError

PREFIX = "x-llama-server-proxy-header-"
# Never forwarded even when named: the body's framing is ours to set, and the target must answer
# uncompressed (the answer streams back as received, llama-server asks for the same).
_REQUEST_DROP = frozenset({"accept-encoding", "transfer-encoding", "content-length", "host", "connection"})
# Set-Cookie: the target's cookies are for its site, never to be planted on this engine's origin.
_RESPONSE_DROP = frozenset(
    {"server", "transfer-encoding", "content-length", "keep-alive", "connection", "date", "set-cookie"}
)
TIMEOUT_S = 600.0  # llama-server's read and write timeouts for the proxy


def forwarded_headers(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The headers sent to the target: exactly the explicitly named proxy headers, renamed."""
    out = {"accept-encoding": "identity"}
    for key, value in headers:
        name = key.lower()
        if name.startswith(PREFIX) and len(name) > len(PREFIX) and name[len(PREFIX) :] not in _REQUEST_DROP:
            out[name[len(PREFIX) :]] = value
    return out


def returned_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The target's answer headers passed back: not hop-by-hop ones, not its CORS ones."""
    return [
        (k, v)
        for k, v in headers
        if k.lower() not in _RESPONSE_DROP and not k.lower().startswith("access-control-")
    ]


def target(url: str) -> str:
    """The URL to forward to, or BadRequest saying why it cannot be."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError as exc:
        raise BadRequest(f"invalid target URL: {exc}", param="url") from None
    if parts.scheme not in ("http", "https"):
        raise BadRequest(f"unsupported URL scheme in target URL: {parts.scheme or '(none)'}", param="url")
    if not parts.hostname:
        raise BadRequest("invalid target URL: missing host", param="url")
    if parts.password is not None or parts.username is not None:
        raise BadRequest("authentication in target URL is not supported", param="url")
    return url


def client() -> httpx.AsyncClient:
    """The proxy's HTTP client (made in the lifespan when --ui-mcp-proxy is on). It keeps no
    cookies: one shared jar would hand a target's cookie to every later caller. The environment's
    proxy settings are not the target's business: trust_env off."""
    no_cookies = CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))
    return httpx.AsyncClient(follow_redirects=True, timeout=TIMEOUT_S, trust_env=False, cookies=no_cookies)


async def cors_proxy(request: Request) -> StreamingResponse:
    proxy: httpx.AsyncClient | None = getattr(request.app.state, "cors_proxy", None)
    if proxy is None:
        raise Forbidden("this feature is disabled", type="feature_disabled")
    url = target(request.query_params.get("url", ""))
    body = await request.body() if request.method == "POST" else None
    outgoing = proxy.build_request(
        request.method, url, headers=forwarded_headers(request.headers.items()), content=body
    )
    try:
        answer = await proxy.send(outgoing, stream=True)
    except httpx.HTTPError as exc:
        raise ServerError(f"proxy error: {exc}") from None
    return StreamingResponse(
        answer.aiter_raw(),
        status_code=answer.status_code,
        headers=dict(returned_headers(answer.headers.items())),
        background=BackgroundTask(answer.aclose),
    )


ROUTES = [Route("/cors-proxy", cors_proxy, methods=["GET", "POST"])]

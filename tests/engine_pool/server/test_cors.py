"""llama-server's CORS on real engine processes: `--cors-origins` (`*`, `localhost`, listed origins),
`--cors-methods`, `--cors-headers`, `--cors-credentials`, and `/cors-proxy` (`--ui-mcp-proxy`),
judged by what a browser would conclude from the answers (support/browser_cors.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.browser_cors import preflight_admits, readable

from engine_pool.http.cors import is_local_origin

from ..conftest import EngineProcess, run_engine

KEY = "sk-cors-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
LOCAL = (
    "http://localhost",
    "http://localhost:8080",
    "http://127.0.0.1",
    "https://127.0.0.1:3000",
    "http://[::1]",
    "http://[::1]:3000",
)
NOT_LOCAL = (
    "http://web.mydomain.fr",
    "http://evil.com",
    "http://notlocalhost",
    "http://localhost.evil.com",
    "http://localhost@evil.com",
    "ftp://localhost",
    "null",
    "localhost",
)


def preflight(
    origin: str, headers: str = "authorization,content-type", method: str = "POST"
) -> dict[str, str]:
    return {
        "Origin": origin,
        "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": headers,
    }


def admits(r: httpx.Response, origin: str, headers: tuple[str, ...], *, credentials: bool = False) -> bool:
    return preflight_admits(r.status_code, r.headers, origin, "POST", headers, credentials=credentials)


def _llama_engine(*args: str) -> Any:
    """A module-scoped fixture: an engine on the tiny llama model, started with `args`."""

    @pytest.fixture(scope="module")
    def engine(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
        yield from run_engine(tmp_path_factory, models["llama"], *args)

    return engine


# llama-server's CORS defaults (any origin, credentials on), behind a key.
default_engine = _llama_engine("--api-key", KEY)
# Only this machine's pages, which may send a key; no credentials; two methods.
local_engine = _llama_engine(
    *("--cors-origins", "localhost"),
    *("--cors-headers", "Authorization, Content-Type"),
    "--no-cors-credentials",
    *("--cors-methods", "GET, POST"),
)
proxy_engine = _llama_engine("--api-key", KEY, "--ui-mcp-proxy")


class _Capture(BaseHTTPRequestHandler):
    """The proxy's target: records each request's headers and body, answers with a cookie, a CORS
    header of its own and a status the test chooses by path."""

    seen: list[tuple[str, dict[str, str], bytes]] = []

    def _answer(self, body: bytes) -> None:
        self.seen.append((self.command, {k.lower(): v for k, v in self.headers.items()}, body))
        status = 201 if self.path.startswith("/created") else 200
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Set-Cookie", "target=1")
        self.send_header("Access-Control-Allow-Origin", "*")
        self.send_header("X-Target", "yes")
        payload = b'{"ok": true}'
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:
        self._answer(b"")

    def do_POST(self) -> None:
        self._answer(self.rfile.read(int(self.headers.get("Content-Length", "0"))))

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def target() -> Iterator[tuple[str, list[tuple[str, dict[str, str], bytes]]]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Capture)
    _Capture.seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", _Capture.seen
    finally:
        server.shutdown()
        server.server_close()


# -- the origin rules (pure) -------------------------------------------------------------------------
def test_only_loopback_hosts_over_http_are_local_origins() -> None:
    assert all(is_local_origin(o) for o in LOCAL)
    assert not any(is_local_origin(o) for o in NOT_LOCAL)
    assert not is_local_origin("http://localhost:notaport")


# -- defaults: any origin, with credentials ------------------------------------------------------------
def test_by_default_any_origin_is_echoed_with_credentials(default_engine: EngineProcess) -> None:
    with httpx.Client(base_url=default_engine.url, timeout=60) as c:
        for origin in ("https://web.mydomain.fr", "http://localhost:5173", "origin"):
            r = c.options(
                "/completions", headers=preflight(origin, "Authorization")
            )  # no key: still answered
            assert r.status_code == 200 and r.content == b""
            assert r.headers["access-control-allow-origin"] == origin
            assert r.headers["access-control-allow-credentials"] == "true"
            assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
            assert r.headers["access-control-allow-headers"] == "*"
            assert admits(r, origin, ("content-type",), credentials=False)
            # llama-server's `*` headers: a browser never lets `*` cover Authorization, so a page on
            # another origin cannot send its key until --cors-headers names it.
            assert not admits(r, origin, ("authorization",))
        page = "https://web.mydomain.fr"
        ok = c.post("/completion", json={"prompt": "hi", "n_predict": 1}, headers={"Origin": page, **AUTH})
        assert ok.status_code == 200 and readable(ok.headers, page, credentials=True)
        assert "origin" in ok.headers["vary"].lower()
        refused = c.post("/completion", json={"prompt": "hi"}, headers={"Origin": page})
        assert refused.status_code == 401 and readable(refused.headers, page, credentials=True)
        bare = c.options("/anything")  # every OPTIONS is a preflight, as in llama-server
        assert bare.status_code == 200 and "access-control-allow-origin" not in bare.headers
        assert "access-control-allow-origin" not in c.get("/health").headers  # no Origin: not a browser


def test_the_proxy_is_refused_without_its_flag(default_engine: EngineProcess) -> None:
    r = httpx.get(f"{default_engine.url}/cors-proxy", params={"url": "http://127.0.0.1:1/"}, headers=AUTH)
    assert r.status_code == 403 and r.json()["error"]["type"] == "feature_disabled"
    assert r.json()["error"]["message"] == "this feature is disabled"


# -- localhost, --cors-headers, --no-cors-credentials, --cors-methods ---------------------------------
def test_localhost_reflects_only_this_machines_pages(local_engine: EngineProcess) -> None:
    with httpx.Client(base_url=local_engine.url, timeout=60) as c:
        for origin in LOCAL:
            r = c.options("/completions", headers=preflight(origin))
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin, origin
            assert r.headers["access-control-allow-credentials"] == "false"
            assert r.headers["access-control-allow-methods"] == "GET, POST"
            assert admits(r, origin, ("authorization", "content-type")), origin  # the key may be sent
            assert not admits(r, origin, ("authorization",), credentials=True)  # but never cookies
            plain = c.get("/health", headers={"Origin": origin})
            assert readable(plain.headers, origin) and not readable(plain.headers, origin, credentials=True)
        for origin in NOT_LOCAL:
            r = c.options("/completions", headers=preflight(origin))
            assert r.status_code == 200 and "access-control-allow-origin" not in r.headers, origin
            assert not admits(r, origin, ("content-type",))
            plain = c.get("/health", headers={"Origin": origin})
            assert plain.status_code == 200 and not readable(plain.headers, origin), origin
            assert "origin" in plain.headers["vary"].lower()


# -- /cors-proxy ------------------------------------------------------------------------------------
def test_the_proxy_forwards_only_explicit_proxy_headers(
    proxy_engine: EngineProcess, target: tuple[str, list[tuple[str, dict[str, str], bytes]]]
) -> None:
    url, seen = target
    sent = {
        **AUTH,
        "Proxy-Authorization": "Basic secret",
        "X-Api-Key": KEY,
        "Cookie": "session=secret",
        "x-llama-server-proxy-header-accept": "application/json",
        "x-llama-server-proxy-header-authorization": "Bearer explicit",
        "x-llama-server-proxy-header-content-type": "application/json",
    }
    got = httpx.get(f"{proxy_engine.url}/cors-proxy", params={"url": f"{url}/capture"}, headers=sent)
    assert got.status_code == 200 and got.json() == {"ok": True}
    assert got.headers["x-target"] == "yes" and "set-cookie" not in got.headers
    assert "access-control-allow-origin" not in got.headers  # the target's CORS is not ours to pass on
    posted = httpx.post(
        f"{proxy_engine.url}/cors-proxy",
        params={"url": f"{url}/created"},
        headers=sent,
        content=b'{"jsonrpc": "2.0"}',
    )
    assert posted.status_code == 201
    (m1, h1, _), (m2, h2, body) = seen
    assert (m1, m2, body) == ("GET", "POST", b'{"jsonrpc": "2.0"}')
    for headers in (h1, h2):
        assert headers["accept"] == "application/json" and headers["authorization"] == "Bearer explicit"
        assert not {"proxy-authorization", "x-api-key", "cookie"} & set(headers)
        assert not any(k.startswith("x-llama-server-proxy-header-") for k in headers)


def test_the_proxy_needs_the_key_and_a_plain_http_url(
    proxy_engine: EngineProcess, target: tuple[str, list[tuple[str, dict[str, str], bytes]]]
) -> None:
    url, seen = target
    base = f"{proxy_engine.url}/cors-proxy"
    assert httpx.get(base, params={"url": url}).status_code == 401
    for bad in (
        "file:///etc/passwd",
        "gopher://127.0.0.1/",
        "http://user:pw@127.0.0.1/",
        "http:///nohost",
        "",
    ):
        r = httpx.get(base, params={"url": bad}, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "url", bad
    assert seen == []
    dead = httpx.get(base, params={"url": "http://127.0.0.1:1/"}, headers=AUTH)
    assert dead.status_code == 500 and dead.json()["error"]["message"].startswith("proxy error")


def test_the_proxy_makes_localhost_the_default_origins(proxy_engine: EngineProcess) -> None:
    with httpx.Client(base_url=proxy_engine.url, timeout=60) as c:
        local = c.options("/cors-proxy", headers=preflight("http://localhost:8080"))
        assert local.headers["access-control-allow-origin"] == "http://localhost:8080"
        evil = c.options("/cors-proxy", headers=preflight("https://evil.example"))
        assert evil.status_code == 200 and "access-control-allow-origin" not in evil.headers

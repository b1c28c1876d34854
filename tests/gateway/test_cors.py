"""The gateway's CORS (`--cors-origins`, llama-server's origin rules): a browser's preflight is
answered without a tenant's key, the responses to an allowed Origin say so, an origin not allowed is
never echoed. Judged by what a browser concludes (support/browser_cors.py). In-process (the app with
its lifespan, no node) for the details, and once through `slotkeeper serve` for the flag's way in."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient
from support.browser_cors import preflight_admits, readable

from gateway.app import build_app
from gateway.main import services
from gateway.metrics import Metrics
from gateway.settings import GatewaySettings, SettingsError, parse_settings

from .conftest import Serve

ORIGIN = "https://app.example"


def preflight(origin: str, method: str = "POST") -> dict[str, str]:
    return {
        "Origin": origin,
        "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": "authorization,content-type,x-stainless-lang",
    }


SENT = ("authorization", "content-type", "x-stainless-lang")  # what the OpenAI JS SDK sends


def admits(r: httpx.Response, origin: str, method: str = "POST", *, credentials: bool = False) -> bool:
    return preflight_admits(r.status_code, r.headers, origin, method, SENT, credentials=credentials)


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Callable[..., TestClient]]:
    """`gateway(cors_origins=...)`: the gateway app over an in-process index and a local store, with a
    tenants file that demands a key."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.acme]\nkeys = ["sk-acme"]\n')
    clients: list[TestClient] = []

    def start(**changes: str) -> TestClient:
        settings = GatewaySettings(data_dir=str(tmp_path / "gw"), tenants=str(tenants), **changes)  # type: ignore[arg-type]
        metrics = Metrics()
        app = build_app(lambda: services(settings, metrics), metrics, settings.cors_origins)
        client = TestClient(app).__enter__()
        clients.append(client)
        return client

    yield start
    for c in clients:
        c.__exit__(None, None, None)


def test_a_preflight_needs_no_key_and_any_origin_is_allowed_by_default(
    gateway: Callable[..., TestClient],
) -> None:
    c = gateway()
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        r = c.options(path, headers=preflight(ORIGIN))
        assert r.status_code == 200, (path, r.text)
        assert r.headers["access-control-allow-origin"] == "*"  # keys, not cookies: no credentials
        assert admits(r, ORIGIN), r.headers  # the key and the SDK's own headers may be sent
        assert not admits(r, ORIGIN, credentials=True)  # cookies never
        assert r.headers["access-control-allow-credentials"] == "false"
    session = c.options("/v1/sessions/s1", headers=preflight(ORIGIN, "DELETE"))
    assert admits(session, ORIGIN, "DELETE")
    # The answers themselves carry the header, refusals too, so a page can read them.
    refused = c.post("/v1/chat/completions", json={}, headers={"Origin": ORIGIN})
    assert refused.status_code == 401 and readable(refused.headers, ORIGIN)
    listed = c.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer sk-acme"})
    assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == "*"
    assert not readable(listed.headers, ORIGIN, credentials=True)
    assert "access-control-allow-origin" not in c.get("/health").headers  # no Origin: not a browser


def test_listed_origins_are_echoed_and_others_are_not(gateway: Callable[..., TestClient]) -> None:
    c = gateway(cors_origins=f"{ORIGIN},localhost")
    for origin in (ORIGIN, "http://localhost:3000", "http://127.0.0.1:8080", "http://[::1]:5173"):
        r = c.options("/v1/chat/completions", headers=preflight(origin))
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin, origin
        assert admits(r, origin), origin
        plain = c.get("/health", headers={"Origin": origin})
        assert (
            plain.headers["access-control-allow-origin"] == origin
            and "origin" in plain.headers["vary"].lower()
        )
    rejected = (
        "https://evil.example",
        "https://app.example.evil.example",
        "http://localhost.evil",
        "http://localhost@evil.example",
        "localhost",
        "null",
    )
    for origin in rejected:
        r = c.options("/v1/chat/completions", headers=preflight(origin))  # answered, as llama-server
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers, origin
        assert not admits(r, origin)
        plain = c.get("/health", headers={"Origin": origin})
        assert plain.status_code == 200 and not readable(plain.headers, origin)


def test_the_flag_and_its_variable() -> None:
    assert parse_settings([], {}).cors_origins == "*"
    assert parse_settings(["--cors-origins", "https://a,https://b"], {}).cors_origins == "https://a,https://b"
    env = {"SLOTKEEPER_CORS_ORIGINS": "localhost"}
    assert parse_settings([], env).cors_origins == "localhost"
    assert parse_settings(["--cors-origins", ORIGIN], env).cors_origins == ORIGIN
    with pytest.raises(SettingsError, match="--cors-origins must be"):
        parse_settings(["--cors-origins", " , "], {})


def test_serve_takes_the_flag(serve: Callable[..., Serve], tmp_path: Path) -> None:
    url = serve(tmp_path / "data", slots=1, args=["--cors-origins", ORIGIN]).url
    ok = httpx.options(f"{url}/v1/chat/completions", headers=preflight(ORIGIN))
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{url}/v1/chat/completions", headers=preflight("https://evil.example"))
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "qwen35", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"Origin": ORIGIN},
        timeout=60,
    )
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN

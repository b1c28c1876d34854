"""`slotkeeper serve --redis-url rediss://…` against a redis-server that speaks TLS only: the gateway
and the node agent reach the index through the URL's CA, a session's next turn is served live from
its slot, and its record is in that server."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
from support.tls import make_certificates, rediss_url, tls_redis

from storage.index.session_index import SessionIndex
from storage.index.topology import connect

from .conftest import Serve

MODEL = "qwen35-seed0"


def _turn(s: Serve, messages: list[dict[str, str]]) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
    r = httpx.post(s.url + "/v1/chat/completions", json=body, headers={"X-Session-Id": "t1"}, timeout=120)
    assert r.status_code == 200, r.text
    return r


async def test_serve_keeps_its_index_on_a_tls_redis(serve: Callable[..., Serve], tmp_path: Path) -> None:
    certs = make_certificates(tmp_path / "tls")
    (tmp_path / "redis").mkdir()
    with tls_redis(tmp_path / "redis", certs) as port:
        url = rediss_url(port, ssl_ca_certs=certs.ca)
        s = serve(tmp_path / "data", slots=1, args=["--redis-url", url])
        messages = [{"role": "user", "content": "Name three colours."}]
        first = _turn(s, messages)
        messages += [
            {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And three more."},
        ]
        assert _turn(s, messages).headers["X-Slotkeeper-Cache"] == "live"
        client = connect(url, decode_responses=True)
        try:
            record = await SessionIndex(client).find("default", "t1")
        finally:
            await client.aclose()
        assert record is not None and record.live and record.tokens > 0

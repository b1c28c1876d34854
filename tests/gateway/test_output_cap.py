"""The output cap of a request that sets no max_tokens, through `slotkeeper serve`: the gateway's
--default-max-tokens, a tenant's own `default_max_tokens`, and a request's max_tokens over both;
a malformed tenant value stops the start."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.tenants import TenantConfigError, parse_tenants

pytestmark = pytest.mark.slow

MODEL = "qwen35-seed0"  # (the tiny model's id)
TENANTS = """
[tenants.capped]
keys = ["key-capped"]
default_max_tokens = 5
[tenants.plain]
keys = ["key-plain"]
"""


def completion_tokens(url: str, key: str, **extra: Any) -> tuple[int, str]:
    story = [{"role": "user", "content": "Tell me a long story."}]
    body = {"model": MODEL, "messages": story, "ignore_eos": True, "temperature": 0, **extra}
    auth = {"Authorization": f"Bearer {key}"}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["completion_tokens"], r.json()["choices"][0]["finish_reason"]


def test_requests_without_max_tokens_are_capped(serve: Any, tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    s = serve(tmp_path / "data", slots=2, tenants=tenants, args=("--default-max-tokens", "9"))
    assert completion_tokens(s.url, "key-capped") == (5, "length")  # the tenant's own cap
    assert completion_tokens(s.url, "key-plain") == (9, "length")  # the gateway's
    assert completion_tokens(s.url, "key-capped", max_tokens=7) == (7, "length")  # the request's wins
    assert completion_tokens(s.url, "key-plain", max_completion_tokens=3) == (3, "length")
    story = {"model": MODEL, "input": "Tell me a long story."}
    auth = {"Authorization": "Bearer key-capped"}
    r = httpx.post(s.url + "/v1/responses", headers=auth, timeout=60, json=story)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["output_tokens"] <= 5


# (path, body, field the 400 names): one rule for the three APIs' output limits, >= 1.
USER = [{"role": "user", "content": "Tell me a long story."}]
BELOW_ONE = [
    *[
        ("/v1/chat/completions", {"messages": USER, name: value}, name)
        for name in ("max_tokens", "max_completion_tokens")
        for value in (0, -1)
    ],
    ("/v1/chat/completions", {"messages": USER, "n_predict": -1}, "n_predict"),  # llama-server's name
    ("/v1/messages", {"messages": USER, "max_tokens": 0}, "max_tokens"),
    ("/v1/responses", {"input": "Tell me a long story.", "max_output_tokens": 0}, "max_output_tokens"),
]


def test_an_output_limit_below_one_is_refused_on_every_api(serve: Any, tmp_path: Path) -> None:
    """0 and -1 are no way around the operator's cap: each API answers 400 naming its field, and no
    engine ran a token for it."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    s = serve(tmp_path / "data", slots=2, tenants=tenants, args=("--default-max-tokens", "9"))
    auth = {"Authorization": "Bearer key-capped", "x-api-key": "key-capped"}
    for path, body, field in BELOW_ONE:
        r = httpx.post(s.url + path, json={"model": MODEL, **body}, headers=auth, timeout=60)
        assert r.status_code == 400, (path, body, r.text)
        error = r.json()["error"]
        message = error["message"]
        assert f"'{field}'" in message and (">= 1" in message or "within 1.." in message), (path, message)
        assert error.get("param", field) == field, (path, error)
    assert completion_tokens(s.url, "key-capped") == (5, "length")  # the cap holds, the engine is fine


@pytest.mark.parametrize("value", ["-1", "1.5", "true", '"many"'])
def test_a_malformed_tenant_cap_is_refused(value: str) -> None:
    cap = tomllib.loads(f"v = {value}")["v"]
    with pytest.raises(TenantConfigError, match="default_max_tokens"):
        parse_tenants({"tenants": {"t": {"keys": ["k"], "default_max_tokens": cap}}})

"""No malformed body reaches a 5xx on the gateway: a property-based fuzz of every tenant endpoint
against a real `slotkeeper serve` (gateway + node agent + an engine on a tiny qwen35 model).

Bodies come from OpenAI's and Anthropic's published request schemas, valid and mutated, and raw
bytes that are no JSON object (gateway.bench.harness.fuzz_bodies). Every answer is a 2xx or a 4xx in
the API's error shape (gateway.bench.harness.fuzz_verdict), and the gateway still serves a valid
turn afterwards. Longer runs: `slotkeeper bench fuzz --minutes 5`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.fuzzing import assert_no_body_gets_a_5xx

from gateway.bench.harness.fuzz_specs import CHAT, GATEWAY_ENDPOINTS, MESSAGES, Endpoint

from .conftest import Serve, start_serve


@pytest.fixture(scope="module")
def gateway(tiny_model: Callable[..., str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    root = tmp_path_factory.mktemp("fuzz-gateway")
    served = start_serve(tiny_model("qwen35"), root / "data", root / "serve.log", slots=2)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def client(gateway: Serve) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=60.0) as c:
        yield c


@pytest.fixture(scope="module")
def model(client: httpx.Client) -> str:
    return str(client.get("/v1/models").json()["data"][0]["id"])


def _turn(model: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": 2}


# Issue 31: an assistant message whose `tool_calls` hold non-objects answered
# `500 internal error: AttributeError` (the gateway's routing digests read them before the engine).
BAD_TOOL_CALLS = [
    ["x"],
    [1, None],
    [{"function": "x"}],
    [{"function": ["x"]}],
    [{"function": {"name": 1, "arguments": {"a": 1}}}],
    5,
    "x",
    {"function": {"name": "f"}},
]


@pytest.mark.parametrize("calls", BAD_TOOL_CALLS, ids=[repr(c)[:30] for c in BAD_TOOL_CALLS])
def test_tool_calls_holding_non_objects_are_a_precise_400(
    client: httpx.Client, model: str, calls: Any
) -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "user", "content": "again"},
    ]
    r = client.post("/v1/chat/completions", json=_turn(model, messages))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert "tool_calls" in err["message"], err


def test_lone_surrogates_in_the_history_are_a_precise_400(client: httpx.Client, model: str) -> None:
    """A `\\ud800` escape parses in Python and decodes to a string no tokenizer or UTF-8 writer
    takes (once a 500 from the engine's tokenizer binding); llama-server refuses it as bad JSON."""
    messages = [
        {"role": "system", "content": "s\ud800"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "a\udfff"},
        {"role": "user", "content": "x\ud83d"},
    ]
    body = json.dumps(_turn(model, messages)).encode()  # ASCII JSON: the surrogates as escapes
    r = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[0].content" and "lone UTF-16 surrogate" in err["message"], err


def test_an_integer_past_pythons_digit_limit_is_a_400(client: httpx.Client, model: str) -> None:
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "seed": %s}' % (
        model.encode(),
        b"1" * 5000,
    )
    r = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "not valid JSON" in r.json()["error"]["message"]


@pytest.mark.parametrize("endpoint", GATEWAY_ENDPOINTS, ids=lambda e: e.name)
def test_no_body_gets_a_5xx(client: httpx.Client, model: str, endpoint: Endpoint) -> None:
    assert_no_body_gets_a_5xx(client, endpoint, model)
    assert client.get("/health").status_code == 200
    ok = client.post(CHAT.path, json=_turn(model, [{"role": "user", "content": "still there?"}]))
    assert ok.status_code == 200, ok.text


def test_anthropic_errors_keep_anthropics_shape(client: httpx.Client, model: str) -> None:
    r = client.post(
        MESSAGES.path,
        json={
            "model": model,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "tool_use", "id": 1}]}],
        },
    )
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["type"] == "error"
    assert isinstance(r.json()["error"]["message"], str)


def test_the_gateway_log_holds_no_unhandled_error(gateway: Serve, client: httpx.Client) -> None:
    """Last in the file: whatever the fuzz sent, nothing fell through to the catch-all handler."""
    assert client.get("/health").status_code == 200
    assert "gateway.unhandled" not in Path(gateway.log).read_text(errors="replace")

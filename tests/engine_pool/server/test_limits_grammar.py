"""Grammars from clients against real engines: a raw GBNF that would crash llama.cpp's recursive
parser is a 400 and the engine keeps serving; schemas are bounded; and converting a large schema
never stalls the event loop (/health keeps answering while it runs)."""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from ..conftest import EngineProcess

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
NESTED_50K = "root ::= " + "(" * 50_000 + '"a"' + ")" * 50_000  # 100 KB: SIGSEGV in llama.cpp unguarded


def _nested(depth: int) -> str:
    return "root ::= " + "(" * depth + '"a"' + ")" * depth


def _alive(eng: EngineProcess, client: httpx.Client) -> None:
    assert eng.proc is not None and eng.proc.poll() is None, "the engine process died"
    r = client.post("/completion", json={"prompt": "Hello world", "n_predict": 2})
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 2, r.text


def test_50000_nested_parentheses_are_refused_and_the_engine_keeps_serving(
    llama_engine: EngineProcess, llama: httpx.Client, limited_engine: EngineProcess, limited: httpx.Client
) -> None:
    # The default engine: over --max-grammar-bytes (64K) already.
    for path, body in [
        ("/completion", {"prompt": "hi", "grammar": NESTED_50K}),
        (CHAT, {"messages": USER, "grammar": NESTED_50K}),
    ]:
        r = llama.post(path, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["message"] == (
            f"'grammar' has {len(NESTED_50K)} bytes; this engine accepts grammars of at most 65536 bytes"
        )
        assert (err["param"], err["limit"]) == ("grammar", 65536)
    _alive(llama_engine, llama)
    # An engine that accepts 256K grammars still refuses the nesting.
    r = limited.post("/completion", json={"prompt": "hi", "grammar": NESTED_50K})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == (
        "'grammar' nests parenthesised groups more than 64 deep; this engine accepts at most 64 levels"
    )
    _alive(limited_engine, limited)


def test_grammar_depth_at_the_limit_is_served_and_literals_do_not_nest(limited: httpx.Client) -> None:
    r = limited.post("/completion", json={"prompt": "hi", "grammar": _nested(64), "n_predict": 4})
    assert r.status_code == 200, r.text
    assert r.json()["content"] == "a"
    r = limited.post(CHAT, json={"messages": USER, "grammar": _nested(65), "max_tokens": 4})
    assert r.status_code == 400 and "more than 64 deep" in r.json()["error"]["message"], r.text
    # A thousand `(` inside a literal and a class: not groups (the scan reads GBNF, not characters).
    parens = 'root ::= "' + "(" * 1000 + '" [(]'
    r = limited.post("/completion", json={"prompt": "hi", "grammar": parens, "n_predict": 1})
    assert r.status_code == 200, r.text


def _chain(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "null"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


@pytest.mark.parametrize(
    ("schema", "message", "limit"),
    [
        (
            {
                "type": "array",
                "items": {
                    "type": "array",
                    "items": {"items": {"items": {"items": {"items": {"items": {"items": {"items": {}}}}}}}},
                },
            },
            "the schema nests deeper than 8 levels (at /items/items/items/items/items/items/items/items)",
            8,
        ),
        (_chain(20), "the schema nests deeper than 8 levels (at /$defs/d7)", 8),
        ({"type": "string", "maxLength": 10**9}, "'maxLength' is 1000000000", None),
        ({"type": "array", "minItems": "2"}, "'minItems' must be a non-negative integer", None),
    ],
)
def test_schemas_past_their_bounds_are_400(
    limited: httpx.Client, schema: dict[str, Any], message: str, limit: int | None
) -> None:
    for path, body in [
        ("/completion", {"prompt": "hi", "json_schema": schema}),
        (
            CHAT,
            {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
        ),
        (
            CHAT,
            {
                "messages": USER,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                "tool_choice": "required",
            },
        ),
    ]:
        r = limited.post(path, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert message in err["message"], err["message"]
        assert err.get("limit") == limit


def test_a_schema_over_the_default_grammar_budget_is_400(llama: httpx.Client) -> None:
    props = {f"p{i}": {"type": "integer"} for i in range(11_000)}  # 3 rules per optional property
    body = {
        "messages": USER,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"schema": {"type": "object", "properties": props}},
        },
    }
    r = llama.post(CHAT, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "its grammar needs more than 32768 rules, the limit of this engine" in err["message"]
    assert (err["param"], err["limit"]) == ("response_format.json_schema.schema", 32768)


def _events(eng: EngineProcess, request_id: str) -> list[str]:
    """The engine's log events of one request, in order."""
    out = []
    for line in eng.log().splitlines():
        if request_id in line and line.startswith("{"):
            entry = json.loads(line)
            if entry.get("request_id") == request_id:
                out.append(entry["event"])
    return out


def _wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_health_answers_while_a_large_schema_is_converted(
    limited_engine: EngineProcess, limited: httpx.Client
) -> None:
    # 40,000 required properties: allowed by this engine, and long enough to convert (about a
    # second) for /health to be asked while it runs.
    props = {f"p{i}": {"type": "integer"} for i in range(40_000)}
    schema = {"type": "object", "properties": props, "required": list(props)}
    rid = f"big-schema-{secrets.token_hex(4)}"
    body = {
        "messages": USER,
        "max_tokens": 1,
        "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
    }
    result: dict[str, httpx.Response] = {}

    def send() -> None:
        with httpx.Client(base_url=limited_engine.url, timeout=120.0) as c:
            result["r"] = c.post(CHAT, json=body, headers={"x-request-id": rid})

    sender = threading.Thread(target=send)
    sender.start()
    answered_during = 0
    try:
        _wait_for(lambda: "grammar.building" in _events(limited_engine, rid), "grammar.building")
        while True:
            events = _events(limited_engine, rid)
            if "grammar.built" in events or "grammar.refused" in events:
                break
            assert limited.get("/health", timeout=60.0).json() == {"status": "ok"}
            # Building was logged before /health was asked; built was not logged when it answered.
            if "grammar.built" not in _events(limited_engine, rid):
                answered_during += 1
    finally:
        sender.join(timeout=120.0)
    assert answered_during >= 1, _events(limited_engine, rid)
    assert result["r"].status_code == 200, result["r"].text[:500]
    assert _events(limited_engine, rid)[:2] == ["grammar.building", "grammar.built"]

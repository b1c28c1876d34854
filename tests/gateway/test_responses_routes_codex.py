"""The Responses API as Codex (0.171) uses it, through a real `slotkeeper serve` on a tiny model with
Qwen3.5's template (it reasons, and writes Qwen3-Coder XML calls): a namespace and a hosted tool on
every request, `store: false` with every item replayed, reasoning sealed for the tenant and
opened again, client_metadata as the session signal; and each new field's hostile values a 4xx."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_pool.protocol import openai_responses as api
from gateway.turn.prompt import prefix_digests, shared_digest
from native.model_gen import write_model

from .conftest import Serve, start_serve

TENANTS = """
[tenants.acme]
keys = ["k-acme"]
models = { "*" = "qwen35-template" }

[tenants.globex]
keys = ["k-globex"]
models = { "*" = "qwen35-template" }
hosted_tools = "refuse"
"""
ACME, GLOBEX = {"authorization": "Bearer k-acme"}, {"authorization": "Bearer k-globex"}
THINK_CLOSE = "8"  # the token of `</think>` in the tiny vocabulary: a bias makes the model close it soon
EXEC = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a command.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"cmd": {"type": "string", "maxLength": 12}},
        "required": ["cmd"],
    },
}
MULTI_AGENT = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for spawning and managing sub-agents.",
    "tools": [
        {
            "type": "function",
            "name": "close_agent",
            "description": "Close an agent.",
            "strict": False,
            "parameters": {
                "type": "object",
                "properties": {"target": {"type": "string", "maxLength": 8}},
                "required": ["target"],
            },
        }
    ],
}
WEB_SEARCH = {"type": "web_search", "external_web_access": False}
INPUT = [
    {
        "type": "message",
        "id": "msg_d",
        "role": "developer",
        "content": [{"type": "input_text", "text": "You are Codex. " * 30}],
    },
    {
        "type": "message",
        "id": "msg_u",
        "role": "user",
        "content": [{"type": "input_text", "text": "list the files"}],
    },
]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Serve, Path, Path]]:
    root = tmp_path_factory.mktemp("codex")
    model = root / "qwen35-template.gguf"
    write_model(str(model), "qwen35", size="tiny", template="qwen35")
    tenants = root / "tenants.toml"
    tenants.write_text(TENANTS)
    s = start_serve(
        str(model), root / "data", root / "serve.log", tenants=tenants, args=("--log-level", "info")
    )
    yield s, model, root
    s.stop(signal.SIGKILL if s.proc.poll() is None else signal.SIGTERM, timeout=30)


def post(s: Serve, body: dict[str, Any], headers: dict[str, str] = ACME, **fields: Any) -> httpx.Response:
    data = {
        "model": "gpt-5-codex",
        "tools": [EXEC, MULTI_AGENT, WEB_SEARCH],
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "max_output_tokens": 300,
        "temperature": 0,
        **body,
        **fields,
    }
    return httpx.post(f"{s.url}/v1/responses", json=data, headers=headers, timeout=120)


def first_turn(s: Serve, thread: str) -> dict[str, Any]:
    """A forced call after some reasoning: its items as Codex keeps them."""
    r = post(
        s,
        {"input": INPUT, "tool_choice": "required", "logit_bias": {THINK_CLOSE: 1.0}},
        client_metadata={"thread_id": thread, "session_id": thread},
    )
    assert r.status_code == 200, r.text
    answer = r.json()
    assert [i["type"] for i in answer["output"]] == ["reasoning", "function_call"], answer["output"]
    return answer


def replay(answer: dict[str, Any], keep: tuple[str, ...]) -> list[dict[str, Any]]:
    """Every item again, the reasoning with only the fields in `keep` of content/encrypted_content,
    then the call's output."""
    out = []
    for item in answer["output"]:
        if item["type"] == "reasoning":
            item = {k: v for k, v in item.items() if k not in ("content", "encrypted_content") or k in keep}
        out.append(item)
    call = answer["output"][-1]
    return [*INPUT, *out, {"type": "function_call_output", "call_id": call["call_id"], "output": "a.py b.py"}]


def test_item_ids_never_reach_the_routing_digests() -> None:
    """Codex's items carry its own ids (new ones for the same text on another run): the chat
    messages, and so the digests that route and share prefixes, are the same without them."""
    bodies = []
    for suffix in ("", "-again"):
        items = [{**item, "id": item["id"] + suffix} for item in INPUT]
        req = api.parse_request(
            {"model": "m", "input": items, "tools": [EXEC, MULTI_AGENT, WEB_SEARCH]}, max_items=64
        )
        bodies.append(api.chat_body(req, []))
    a, b = bodies
    assert prefix_digests(a["messages"], "m") == prefix_digests(b["messages"], "m")
    assert shared_digest(a["messages"], a["tools"], "m") == shared_digest(b["messages"], b["tools"], "m")


def test_a_replayed_conversation_renders_its_sealed_reasoning_again(served: tuple[Serve, Path, Path]) -> None:
    s, _, _ = served
    first = first_turn(s, "thread-replay")
    reasoning = first["output"][0]
    assert reasoning["encrypted_content"].startswith("skr1_") and reasoning["content"][0]["text"]
    assert reasoning["content"][0]["text"] not in reasoning["encrypted_content"]
    meta = {"client_metadata": {"thread_id": "thread-replay"}}
    sealed = post(s, {"input": replay(first, ("encrypted_content",)), "max_output_tokens": 2, **meta})
    assert sealed.status_code == 200, sealed.text
    usage = sealed.json()["usage"]
    # Turn 1's prompt is reused (up to where the engine's reply was rendered again by the template).
    assert usage["input_tokens_details"]["cached_tokens"] >= first["usage"]["input_tokens"] - 4
    plain = post(s, {"input": replay(first, ("content",)), "max_output_tokens": 2, **meta}).json()
    lost = post(s, {"input": replay(first, ()), "max_output_tokens": 2, **meta}).json()
    # The sealed text renders what the plain text does; without either the reasoning is gone.
    assert plain["usage"]["input_tokens"] == usage["input_tokens"] > lost["usage"]["input_tokens"]
    assert plain["usage"]["input_tokens_details"]["cached_tokens"] == usage["input_tokens"]


def test_hosted_tools_are_left_out_and_said_so_or_refused_per_tenant(
    served: tuple[Serve, Path, Path],
) -> None:
    s, _, root = served
    r = post(s, {"input": "hi", "max_output_tokens": 2})
    assert r.status_code == 200 and r.headers["x-slotkeeper-omitted-tools"] == "web_search"
    assert r.json()["slotkeeper"]["omitted_tools"] == [{"type": "web_search", "param": "tools[2]"}]
    body = {"model": "m", "input": "hi", "tools": [WEB_SEARCH], "stream": True, "max_output_tokens": 2}
    with httpx.stream("POST", f"{s.url}/v1/responses", headers=ACME, timeout=60, json=body) as streamed:
        assert streamed.status_code == 200 and streamed.headers["x-slotkeeper-omitted-tools"] == "web_search"
        streamed.read()
    metrics = httpx.get(f"{s.url}/metrics", timeout=10).text
    assert 'slotkeeper_gateway_hosted_tools_omitted_total{type="web_search"}' in metrics
    logged = [
        json.loads(line) for line in (root / "serve.log").read_text().splitlines() if "tools_omitted" in line
    ]
    assert logged and logged[0]["tenant"] == "acme" and logged[0]["tools"][0]["type"] == "web_search"
    refused = post(s, {"input": "hi"}, GLOBEX)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools[2]"
    assert "'web_search' runs on OpenAI's servers" in refused.json()["error"]["message"]


def test_client_metadata_names_the_thread_s_session(served: tuple[Serve, Path, Path]) -> None:
    s, _, _ = served

    def session(thread: str, session_id: str) -> str:
        meta = {"thread_id": thread, "session_id": session_id, "turn_id": "t", "x-codex-window-id": "w:0"}
        r = post(s, {"input": INPUT, "max_output_tokens": 2, "client_metadata": meta})
        assert r.status_code == 200, r.text
        return r.headers["x-session-id"]

    main = session("thread-a", "cli-1")
    assert session("thread-a", "cli-1").split(".")[0] == main.split(".")[0]  # (a branch keeps its root)
    assert session("thread-b", "cli-1").split(".")[0] != main.split(".")[0]  # a sub-agent's own thread
    # Codex's headers and its client_metadata with the same id: one session.
    r = post(
        s,
        {"input": INPUT, "max_output_tokens": 2},
        {**ACME, "session-id": "thread-a", "thread-id": "thread-a"},
    )
    assert r.headers["x-session-id"].split(".")[0] == main.split(".")[0]


def test_reasoning_sealed_for_one_tenant_does_not_open_for_another(served: tuple[Serve, Path, Path]) -> None:
    s, _, _ = served
    first = first_turn(s, "thread-foreign")
    items = replay(first, ("encrypted_content",))
    r = post(s, {"input": items, "tools": [EXEC, MULTI_AGENT], "max_output_tokens": 2}, GLOBEX)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "input[2].encrypted_content"
    assert "sealed for another tenant" in r.json()["error"]["message"]


BAD = [
    ({"client_metadata": {f"k{i}": "v" for i in range(40)}}, "client_metadata"),
    ({"client_metadata": {"thread_id": "t" * 300}}, "client_metadata.thread_id"),
    ({"client_metadata": {"x": "v" * 5000}}, "client_metadata.x"),
    ({"tools": [{**MULTI_AGENT, "tools": [MULTI_AGENT]}]}, "tools[0].tools[0]"),
    ({"tools": [{**MULTI_AGENT, "tools": [MULTI_AGENT["tools"][0]] * 200}]}, "tools[0].tools"),
    (
        {
            "tools": [
                {
                    "type": "custom",
                    "name": "p",
                    "format": {"type": "grammar", "syntax": "regex", "definition": "a(?=b)"},
                }
            ]
        },
        "tools[0].format.definition",
    ),
    (
        {
            "tools": [
                {
                    "type": "custom",
                    "name": "p",
                    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: start "a" | "b"'},
                }
            ]
        },
        "tools[0].format.definition",
    ),
    (
        {
            "tools": [
                {
                    "type": "custom",
                    "name": "p",
                    "format": {"type": "grammar", "syntax": "regex", "definition": "(" * 5000},
                }
            ]
        },
        "tools[0].format.definition",
    ),
    (
        {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "skr1_" + "A" * 64}]},
        "input[0].encrypted_content",
    ),
    (
        {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAA-openai"}]},
        "input[0].encrypted_content",
    ),
]


@pytest.mark.parametrize(("fields", "param"), BAD, ids=[p for _, p in BAD])
def test_hostile_new_fields_are_a_precise_400(
    served: tuple[Serve, Path, Path], fields: dict[str, Any], param: str
) -> None:
    s, _, _ = served
    r = post(s, {"input": "hi", "max_output_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_sealed_reasoning_opens_after_serve_restarts(served: tuple[Serve, Path, Path]) -> None:
    """Last: the data directory keeps the sealing key, so a replay after a restart still opens."""
    s, model, root = served
    first = first_turn(s, "thread-restart")
    assert s.stop() == 0
    again = start_serve(str(model), root / "data", root / "serve-2.log", tenants=root / "tenants.toml")
    try:
        r = post(again, {"input": replay(first, ("encrypted_content",)), "max_output_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        again.stop()

"""Every list and string a client controls has a bound: at the limit the request is served, one past
it is a 400 naming the field and the limit (the limited engine: see conftest.LIMITED_ARGS)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

CHAT = "/v1/chat/completions"
N_CTX = 4096  # --ctx-size 4096, one slot
CALL = {"type": "function", "function": {"name": "f", "arguments": "{}"}}


def _messages(n: int, text: str = "hi") -> list[dict[str, Any]]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i in range(n)]


def _tools(n: int) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": {}}} for i in range(n)]


# (path, body within the limit, the same one past it, message part, limit)
BOUNDS: list[tuple[str, dict[str, Any], dict[str, Any], str, int]] = [
    (
        "/apply-template",
        {"messages": _messages(4)},
        {"messages": _messages(5)},
        "'messages' has 5 messages; this engine accepts at most 4",
        4,
    ),
    (
        "/apply-template",
        {"messages": _messages(1), "tools": _tools(2)},
        {"messages": _messages(1), "tools": _tools(3)},
        "'tools' has 3 tools; this engine accepts at most 2",
        2,
    ),
    (
        "/apply-template",
        {"messages": [{"role": "user", "content": "x" * 1996}]},  # the role counts too
        {"messages": [{"role": "user", "content": "x" * 1997}]},
        "'messages' has 2001 characters of text; this engine accepts at most 2000",
        2000,
    ),
    (
        "/apply-template",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 4}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 5}]},
        "'messages[0].content' has 5 content parts; this engine accepts at most 4",
        4,
    ),
    (
        "/apply-template",
        {"messages": [{"role": "assistant", "content": "", "tool_calls": [CALL] * 2}]},
        {"messages": [{"role": "assistant", "content": "", "tool_calls": [CALL] * 3}]},
        "'messages[0].tool_calls' has 3 tool calls; this engine accepts at most 2",
        2,
    ),
    (
        "/completion",
        {"prompt": "hi", "n_predict": 1, "stop": ["a", "b"]},
        {"prompt": "hi", "n_predict": 1, "stop": ["a", "b", "c"]},
        "'stop' has 3 strings; this engine accepts at most 2",
        2,
    ),
    (
        "/completion",
        {"prompt": "hi", "n_predict": 1, "stop": "12345678"},
        {"prompt": "hi", "n_predict": 1, "stop": "123456789"},
        "'stop[0]' has 9 characters; this engine accepts at most 8",
        8,
    ),
    (
        "/completion",
        {"prompt": "hi", "n_predict": 1, "logit_bias": [[1, 0.5], [2, 0.5], [3, 0.5]]},
        {"prompt": "hi", "n_predict": 1, "logit_bias": {"1": 0.5, "2": 0.5, "3": 0.5, "4": 0.5}},
        "'logit_bias' has 4 entries; this engine accepts at most 3",
        3,
    ),
    (
        "/completion",
        {"prompt": "x" * 2000, "n_predict": 1},
        {"prompt": "x" * 2001, "n_predict": 1},
        "'prompt' has 2001 characters of text; this engine accepts at most 2000",
        2000,
    ),
    (
        "/v1/completions",
        {"prompt": ["a", "b"], "max_tokens": 1},
        {"prompt": ["a", "b", "c"], "max_tokens": 1},
        "'prompt' has 3 prompts (at most one per slot and queue place); this engine accepts at most 2",
        2,
    ),
    (
        "/v1/completions",
        {"prompt": ["x" * 1000, "y" * 1000], "max_tokens": 1},
        {"prompt": ["x" * 1000, "y" * 1001], "max_tokens": 1},
        "'prompt' has 2001 characters of text; this engine accepts at most 2000",
        2000,
    ),
    (
        "/tokenize",
        {"content": "x" * 2000},
        {"content": "x" * 2001},
        "'content' has 2001 characters of text; this engine accepts at most 2000",
        2000,
    ),
    (
        "/detokenize",
        {"tokens": [1] * 2000},
        {"tokens": [1] * 2001},
        "'tokens' has 2001 tokens; this engine accepts at most 2000",
        2000,
    ),
    (
        CHAT,
        {"messages": _messages(1), "max_tokens": 1, "stop": ["a", "b"]},
        {"messages": _messages(1), "max_tokens": 1, "stop": ["a", "b", "c"]},
        "'stop' has 3 strings; this engine accepts at most 2",
        2,
    ),
    (
        CHAT,
        {"messages": _messages(3), "max_tokens": 1},
        {"messages": _messages(5), "max_tokens": 1},
        "'messages' has 5 messages; this engine accepts at most 4",
        4,
    ),
]


@pytest.mark.parametrize(
    ("path", "ok", "over", "message", "limit"), BOUNDS, ids=[f"{b[0]} {b[3][:24]}" for b in BOUNDS]
)
def test_at_the_limit_served_past_it_refused(
    limited: httpx.Client, path: str, ok: dict[str, Any], over: dict[str, Any], message: str, limit: int
) -> None:
    r = limited.post(path, json=ok)
    assert r.status_code == 200, r.text
    r = limited.post(path, json=over)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["limit"]) == ("invalid_request_error", "invalid_request", limit)
    assert message in err["message"], err["message"]


@pytest.mark.parametrize(
    ("path", "field", "body"),
    [
        ("/completion", "n_predict", {"prompt": "hi"}),
        ("/v1/completions", "max_tokens", {"prompt": "hi"}),
        (CHAT, "max_tokens", {"messages": _messages(1)}),
        (CHAT, "max_completion_tokens", {"messages": _messages(1)}),
    ],
)
def test_more_tokens_than_a_slot_holds_is_refused_with_both_numbers(
    limited: httpx.Client, path: str, field: str, body: dict[str, Any]
) -> None:
    # llama-server would clamp this silently; the client learns both numbers instead.
    r = limited.post(path, json={**body, field: N_CTX + 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"].startswith(
        f"'{field}' is {N_CTX + 1}, more than a slot's context of {N_CTX} tokens"
    )
    assert (err["param"], err["n_ctx"]) == (field, N_CTX)


def test_token_prompts_longer_than_a_slot_are_refused_before_tokenizing(limited: httpx.Client) -> None:
    r = limited.post("/completion", json={"prompt": [1] * N_CTX})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "exceed_context_size_error"
    assert (err["n_prompt_tokens"], err["n_ctx"]) == (N_CTX, N_CTX)

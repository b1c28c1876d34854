"""Bad input on every endpoint: a precise 4xx in OpenAI's error shape, and the engine stays up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from ..conftest import ENGINE_COMMAND, EngineProcess

LONG = "word " * 3000  # far more than a slot's 1024 tokens
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

# (method, path, body (dict/list: JSON, str: raw bytes, None: none), status, error type, message part)
CASES: list[tuple[str, str, Any, int, str, str]] = [
    ("POST", "/completion", "{not json", 400, "invalid_request_error", "not valid JSON"),
    ("POST", "/completion", "", 400, "invalid_request_error", "body is empty"),
    ("POST", "/completion", [1, 2], 400, "invalid_request_error", "must be a JSON object, got array"),
    ("POST", "/completion", {}, 400, "invalid_request_error", "'prompt' is required"),
    ("POST", "/completion", {"prompt": 5}, 400, "invalid_request_error", "'prompt' must be a string"),
    ("POST", "/completion", {"prompt": [1, 99999]}, 400, "invalid_request_error", "outside the vocabulary"),
    ("POST", "/completion", {"prompt": [1, "x", True]}, 400, "invalid_request_error", "'prompt' must be"),
    (
        "POST",
        "/completion",
        {"prompt": "hi", "n_predict": "8"},
        400,
        "invalid_request_error",
        "'n_predict' must be an integer, got string",
    ),
    (
        "POST",
        "/completion",
        {"prompt": "hi", "temperature": True},
        400,
        "invalid_request_error",
        "'temperature' must be a number, got boolean",
    ),
    (
        "POST",
        "/completion",
        {"prompt": "hi", "top_p": 2},
        400,
        "invalid_request_error",
        "'top_p' must be within",
    ),
    (
        "POST",
        "/completion",
        {"prompt": "hi", "id_slot": 7},
        400,
        "invalid_request_error",
        "'id_slot' 7 does not exist",
    ),
    ("POST", "/completion", {"prompt": "hi", "stop": 3}, 400, "invalid_request_error", "'stop' must be"),
    (
        "POST",
        "/completion",
        {"prompt": "hi", "logit_bias": {"": 1}},
        400,
        "invalid_request_error",
        "neither a token id nor a non-empty text",
    ),
    (
        "POST",
        "/completion",
        {"prompt": "hi", "grammar": "root ::= ("},
        400,
        "invalid_request_error",
        "grammar",
    ),
    (
        "POST",
        "/completion",
        {"prompt": "hi", "json_schema": {"type": "string", "pattern": "a+"}},
        400,
        "invalid_request_error",
        "unsupported JSON schema keyword(s) pattern",
    ),
    (
        "POST",
        "/completion",
        {"prompt": "hi", "json_schema": {"type": "array", "minItems": "x"}},
        400,
        "invalid_request_error",
        "'minItems' must be a non-negative integer",
    ),
    (
        "POST",
        "/completion",
        {"prompt": "hi", "top_k": 2**40},  # past a C int: once a TypeError (500) in the binding
        400,
        "invalid_request_error",
        "'top_k' must be within 0..2147483647",
    ),
    (
        "POST",
        "/completion",
        {"prompt": "hi", "repeat_last_n": 2_000_000_000, "repeat_penalty": 1.1},
        400,
        "invalid_request_error",
        "'repeat_last_n' is 2000000000, more than a slot's context of 1024 tokens",
    ),
    (
        "POST",
        "/completion",
        {"prompt": "hi", "n_predict": 5000},
        400,
        "invalid_request_error",
        "'n_predict' is 5000, more than a slot's context of 1024 tokens",
    ),
    # The output limit under OpenAI's names is a count of tokens: 0 and -1 are refused, never "no
    # limit"; under a gateway's cap (`max_tokens_default`), llama-server's n_predict -1 is refused too.
    *[
        ("POST", path, {**body, name: value}, 400, "invalid_request_error", f"'{name}' must be within 1..")
        for path, body in ((CHAT, {"messages": USER}), ("/v1/completions", {"prompt": "hi"}))
        for name in ("max_tokens", "max_completion_tokens")
        for value in (0, -1)
    ],
    *[
        ("POST", path, {**body, "n_predict": -1, "max_tokens_default": 5}, 400, "invalid_request_error", m)
        for path, body in ((CHAT, {"messages": USER}), ("/completion", {"prompt": "hi"}))
        for m in ("'n_predict' must be within 1..",)
    ],
    (
        "POST",
        CHAT,
        {"messages": USER, "max_tokens_default": 0},
        400,
        "invalid_request_error",
        "'max_tokens_default' must be within 1..",
    ),
    (
        "POST",
        "/completion",
        {"prompt": LONG},
        400,
        "exceed_context_size_error",
        "exceeds the available context",
    ),
    ("POST", CHAT, {"model": "m"}, 400, "invalid_request_error", "'messages' must be a non-empty array"),
    ("POST", CHAT, {"messages": []}, 400, "invalid_request_error", "'messages' must be a non-empty array"),
    ("POST", CHAT, {"messages": ["hi"]}, 400, "invalid_request_error", "'messages[0]' must be an object"),
    (
        "POST",
        CHAT,
        {"messages": [{"role": "user"}]},
        400,
        "invalid_request_error",
        "'messages[0].content' is",
    ),
    (
        "POST",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "invalid_request_error",
        "content part type 'image_url' is not supported",
    ),
    (
        "POST",
        CHAT,
        {"messages": USER, "stream": "yes"},
        400,
        "invalid_request_error",
        "'stream' must be a boolean",
    ),
    ("POST", CHAT, {"messages": USER, "n": 2, "stream": True}, 400, "invalid_request_error", "'stream'"),
    ("POST", CHAT, {"messages": USER, "n": 0}, 400, "invalid_request_error", "within 1.."),
    (
        "POST",
        CHAT,
        {"messages": USER, "tool_choice": "required"},
        400,
        "invalid_request_error",
        "no 'tools' were given",
    ),
    (
        "POST",
        CHAT,
        {
            "messages": USER,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        400,
        "invalid_request_error",
        "'g', which is not among 'tools'",
    ),
    (
        "POST",
        CHAT,
        {"messages": USER, "tools": [{"type": "function"}]},
        400,
        "invalid_request_error",
        "'tools[0]'",
    ),
    (
        "POST",
        CHAT,
        {"messages": USER, "response_format": {"type": "xml"}},
        400,
        "invalid_request_error",
        "'response_format.type' must be one of",
    ),
    (
        "POST",
        CHAT,
        {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        400,
        "invalid_request_error",
        "json_schema.schema' must be a JSON schema",
    ),
    (
        "POST",
        CHAT,
        {
            "messages": USER,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"$ref": "https://example.com/s.json"}},
            },
        },
        400,
        "invalid_request_error",
        "only local references",
    ),
    (
        "POST",
        CHAT,
        {"messages": [{"role": "user", "content": LONG}]},
        400,
        "exceed_context_size_error",
        "exceeds the available context",
    ),
    ("POST", "/v1/completions", {"model": "m"}, 400, "invalid_request_error", "'prompt' is required"),
    ("POST", "/v1/completions", {"prompt": {"a": 1}}, 400, "invalid_request_error", "'prompt' must be"),
    (
        "POST",
        "/v1/completions",
        {"prompt": "hi", "echo": True},
        400,
        "invalid_request_error",
        "'echo' is not",
    ),
    (
        "POST",
        "/v1/completions",
        {"prompt": ["a", "b"], "stream": True},
        400,
        "invalid_request_error",
        "exactly one prompt",
    ),
    ("POST", "/tokenize", {}, 400, "invalid_request_error", "'content' is required"),
    ("POST", "/tokenize", {"content": 5}, 400, "invalid_request_error", "'content' must be a string"),
    (
        "POST",
        "/detokenize",
        {"tokens": ["a"]},
        400,
        "invalid_request_error",
        "'tokens[0]' must be a token id",
    ),
    ("POST", "/detokenize", {"tokens": [-1]}, 400, "invalid_request_error", "outside the vocabulary"),
    ("POST", "/detokenize", {}, 400, "invalid_request_error", "'tokens' is required"),
    (
        "POST",
        "/apply-template",
        {"messages": "x"},
        400,
        "invalid_request_error",
        "'messages' must be an array",
    ),
    ("POST", "/slots/0?action=bogus", {}, 400, "invalid_request_error", "'action' must be one of"),
    ("POST", "/slots/0", {}, 400, "invalid_request_error", "'action' must be one of"),
    ("POST", "/slots/9?action=erase", None, 404, "not_found_error", "slot '9' does not exist"),
    ("POST", "/slots/abc?action=erase", None, 404, "not_found_error", "slot 'abc' does not exist"),
    (
        "POST",
        "/slots/0?action=save",
        {"filename": "../x.slot"},
        400,
        "invalid_request_error",
        "without directories",
    ),
    (
        "POST",
        "/slots/0?action=save",
        {"filename": "/etc/passwd"},
        400,
        "invalid_request_error",
        "without directories",
    ),
    (
        "POST",
        "/slots/0?action=save",
        {"filename": ".hidden"},
        400,
        "invalid_request_error",
        "must not start with",
    ),
    ("POST", "/slots/0?action=save", {"filename": "a b"}, 400, "invalid_request_error", "may only contain"),
    (
        "POST",
        "/slots/0?action=save",
        {"filename": "x" * 300},
        400,
        "invalid_request_error",
        "longer than 255",
    ),
    ("POST", "/slots/0?action=save", {"filename": 5}, 400, "invalid_request_error", "non-empty string"),
    ("POST", "/slots/0?action=save", {}, 400, "invalid_request_error", "non-empty string"),
    (
        "POST",
        "/slots/0?action=restore",
        {"filename": "missing.slot"},
        404,
        "not_found_error",
        "does not exist",
    ),
    (
        "POST",
        "/slots/0?action=restore",
        {"filename": "..\\x"},
        400,
        "invalid_request_error",
        "without directories",
    ),
    ("GET", "/completion", None, 405, "invalid_request_error", "Method Not Allowed"),
    ("GET", "/no-such-endpoint", None, 404, "not_found_error", "Not Found"),
]


def _send(c: httpx.Client, method: str, path: str, body: Any) -> httpx.Response:
    if isinstance(body, str):
        return c.request(method, path, content=body.encode(), headers={"content-type": "application/json"})
    return c.request(method, path, json=body) if body is not None else c.request(method, path)


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "etype", "message"),
    CASES,
    ids=[f"{c[0]} {c[1]} #{i}" for i, c in enumerate(CASES)],
)
def test_bad_input_is_a_precise_4xx(
    llama: httpx.Client, method: str, path: str, body: Any, status: int, etype: str, message: str
) -> None:
    r = _send(llama, method, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == etype
    assert isinstance(err["code"], str) and err["code"]
    assert message in err["message"], err["message"]


def test_context_overflow_reports_sizes(llama: httpx.Client) -> None:
    err = llama.post("/completion", json={"prompt": LONG}).json()["error"]
    assert err["n_ctx"] == 1024 and err["n_prompt_tokens"] > 1024


def test_damaged_slot_file_is_refused_precisely_and_leaves_the_slot_empty(
    llama: httpx.Client, slot_dir: Path
) -> None:
    r = llama.post("/completion", json={"prompt": "Hello world", "id_slot": 0, "n_predict": 2})
    assert r.status_code == 200
    assert llama.post("/slots/0?action=save", json={"filename": "good.slot"}).status_code == 200
    good = (slot_dir / "llama" / "good.slot").read_bytes()
    damaged = {
        "truncated.slot": good[: len(good) // 2],
        "flipped.slot": good[:100] + bytes([good[100] ^ 0xFF]) + good[101:],
        "garbage.slot": b"not a slot file at all" * 10,
    }
    for name, data in damaged.items():
        (slot_dir / "llama" / name).write_bytes(data)
        assert llama.post("/slots/0?action=restore", json={"filename": "good.slot"}).status_code == 200
        r = llama.post("/slots/0?action=restore", json={"filename": name})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error"
        assert err["kind"] in ("truncated", "checksum_mismatch", "bad_magic", "bad_layout")
        assert f"cannot restore slot 0 from '{name}': {err['kind']}" in err["message"]
        assert "the slot was left empty" in err["message"]
        assert llama.get("/slots").json()[0]["n_tokens"] == 0


def test_engine_still_healthy_after_the_matrix(llama: httpx.Client) -> None:
    assert llama.get("/health").json() == {"status": "ok"}
    r = llama.post("/completion", json={"prompt": "Hello world", "n_predict": 3})
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 3


def test_unknown_flag_is_a_clear_error(models: dict[str, Path], tmp_path: Path) -> None:
    import subprocess

    r = subprocess.run(
        [*ENGINE_COMMAND, "-m", str(models["llama"]), "--bogus", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "unrecognized arguments: --bogus 1" in r.stderr


def test_model_that_fails_to_load_exits_1(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF but not really")
    eng = EngineProcess(bad, log_path=tmp_path / "bad.log")
    with pytest.raises(RuntimeError, match="engine exited with 1"):
        eng.start(timeout_s=60)
    assert "engine.load_failed" in eng.log()

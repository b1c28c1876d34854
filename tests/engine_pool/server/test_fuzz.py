"""No malformed body reaches a 5xx on an engine (`slotkeeper engine`, the llama-server drop-in): a
property-based fuzz of its request parsers, OpenAI's and Anthropic's endpoints and llama-server's own.

Bodies come from the published request schemas (llama-server's written from its README), valid and
mutated, and raw bytes that are no JSON object (gateway.bench.harness.fuzz_bodies). Every answer is
a 2xx or a 4xx in the API's error shape (gateway.bench.harness.fuzz_verdict), and the engine still
serves afterwards. Longer runs: `slotkeeper bench fuzz --minutes 5`.
"""

from __future__ import annotations

import httpx
import pytest
from support.fuzzing import assert_no_body_gets_a_5xx

from gateway.bench.harness.fuzz_specs import ENGINE_ENDPOINTS, Endpoint

from ..conftest import EngineProcess


@pytest.mark.parametrize("endpoint", ENGINE_ENDPOINTS, ids=lambda e: e.name)
def test_no_body_gets_a_5xx(qwen: httpx.Client, endpoint: Endpoint) -> None:
    assert_no_body_gets_a_5xx(qwen, endpoint, "tiny-qwen")
    assert qwen.get("/health").status_code == 200
    ok = qwen.post("/completion", json={"prompt": "still there?", "n_predict": 2})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "\\ud800"}',
        b'{"prompt": "a", "temperature": NaN}',
        b'{"prompt": "a", "seed": 1e400}',
        b'{"prompt": "a", "seed": ' + b"1" * 5000 + b"}",
    ],
    ids=["lone surrogate", "NaN", "1e400", "5000 digits"],
)
def test_text_and_numbers_python_alone_would_take_are_a_400(qwen: httpx.Client, raw: bytes) -> None:
    """What llama-server's parser refuses, and what once reached a binding as a 500 (a lone
    surrogate cannot become the tokenizer's UTF-8)."""
    r = qwen.post("/completion", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_token_inside_a_utf8_sequence_detokenizes_with_a_replacement(qwen: httpx.Client) -> None:
    # Byte-fallback tokens hold single bytes of a multi-byte character (as llama-server: U+FFFD).
    pieces = qwen.post("/tokenize", json={"content": "é", "with_pieces": False}).json()["tokens"]
    whole = qwen.post("/detokenize", json={"tokens": pieces}).json()["content"]
    assert whole == "é"
    for token in pieces if len(pieces) > 1 else [137]:
        r = qwen.post("/detokenize", json={"tokens": [token]})
        assert r.status_code == 200 and isinstance(r.json()["content"], str)
    r = qwen.post("/completion", json={"prompt": [137], "n_predict": 1})
    assert r.status_code == 200, r.text


def test_the_engine_log_holds_no_unhandled_error(qwen_engine: EngineProcess, qwen: httpx.Client) -> None:
    """Last in the file: whatever the fuzz sent, nothing fell through to the catch-all handler."""
    assert qwen.get("/health").status_code == 200
    assert "http.unhandled" not in qwen_engine.log()

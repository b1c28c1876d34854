"""llama-server's own suite (tools/server/tests/unit, b11434), the assertions `slotkeeper engine`
failed before issue 31, mirrored on a real engine: `/metrics` in llama-server's families and with
its `Process-Start-Time-Unix` header (test_metrics.py), the model id among several aliases
(test_basic.py), `__verbose` (test_chat_completion.py), Anthropic's thinking budget, empty
conversation, streamed token counts and images inside `tool_result` (test_compat_anthropic.py), a
Responses request without `model` (test_compat_oai_responses.py), `return_progress` and
`timings_per_token` on chat, completion and Responses streams, `ignore_eos`'s bans
(test_ignore_eos.py), a prefill in text parts, header names in llama-server's case
(test_security.py, test_metrics.py) and Vertex AI's `/predict` (test_compat_gcp.py).
Each test names the upstream one.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_pool.server.header_case import canonical_head, canonical_name
from engine_pool.server.metrics import LLAMACPP, LlamaStats, llamacpp_text, llamacpp_values
from engine_pool.server.settings import SettingsError, parse_settings

from ..conftest import EngineProcess, run_engine

BOOK = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
RED_PIXEL = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="
DECODE_FAMILIES = {"n_decode_total", "n_busy_slots_per_decode"}  # need the core's decode count


@pytest.fixture(scope="module")
def engine(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """As upstream's `tinyllama2` preset with `--metrics`, three aliases and three tags."""
    args = ("-np", "2", "-c", "1024", "-b", "32", "--metrics")
    yield from run_engine(
        tmp_path_factory, models["llama"], *args, "-a", "tinyllama-2,fim,code", "--tags", "chat,fim,small"
    )


@pytest.fixture
def c(engine: EngineProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine.url, timeout=60.0) as client:
        yield client


def _ok(r: httpx.Response) -> Any:
    assert r.status_code == 200, r.text
    return r.json()


def _sse(c: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with c.stream("POST", path, json=body) as s:
        assert s.status_code == 200, s.read()
        return [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]


def parse_metrics(text: str) -> dict[str, tuple[str, float]]:
    """upstream test_metrics.parse_metrics: {name: (type, value)} of the unlabelled llamacpp: lines,
    each of which must follow its TYPE line."""
    out, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line.startswith("llamacpp:") and "{" not in line:
            name, value = line.split(" ", 1)
            assert name in types, f"{name} has no # TYPE line"
            out[name] = (types[name], float(value))
    return out


def fetch_metrics(c: httpx.Client) -> tuple[str, dict[str, tuple[str, float]]]:
    r = c.get("/metrics")
    assert r.status_code == 200
    started = int(r.headers["Process-Start-Time-Unix"])
    assert time.time() - 3600 < started <= time.time()
    return r.text, parse_metrics(r.text)


def _complete(c: httpx.Client, n_predict: int, prompt: Any = "I believe", **extra: Any) -> dict[str, Any]:
    result: dict[str, Any] = _ok(
        c.post("/completion", json={"prompt": prompt, "n_predict": n_predict, **extra})
    )
    return result


# -- test_metrics.py --------------------------------------------------------------------------------
def test_metrics_prometheus_format(c: httpx.Client) -> None:
    _complete(c, 8)
    text, metrics = fetch_metrics(c)
    for name, kind, help_text in LLAMACPP:
        if name in DECODE_FAMILIES and f"llamacpp:{name}" not in metrics:
            continue  # (reported once the core counts its llama_decode calls)
        assert metrics[f"llamacpp:{name}"][0] == kind
        assert f"# HELP llamacpp:{name} {help_text}\n" in text
    assert metrics["llamacpp:requests_processing"][1] == 0
    assert metrics["llamacpp:requests_deferred"][1] == 0
    assert metrics["llamacpp:n_tokens_max"][1] >= 8
    assert metrics["llamacpp:spec_decode_num_drafts_total"][1] == 0


def test_metrics_prompt_processed_and_cached(c: httpx.Client) -> None:
    _, before = fetch_metrics(c)
    prompt = "the quick brown fox jumps over the lazy dog"
    timings = [_complete(c, 4, prompt, id_slot=0)["timings"] for _ in range(2)]
    assert timings[1]["cache_n"] > 0  # the second reuses the first's prompt
    _, after = fetch_metrics(c)

    def grew(name: str) -> float:
        return after[name][1] - before[name][1]

    # Cached tokens are counted apart: they cost no decode.
    assert grew("llamacpp:prompt_tokens_total") == sum(t["prompt_n"] for t in timings)
    assert grew("llamacpp:prompt_tokens_cached_total") == sum(t["cache_n"] for t in timings)
    assert grew("llamacpp:prompt_seconds_total") == pytest.approx(sum(t["prompt_ms"] for t in timings) / 1e3)


def test_metrics_predicted_total_matches_requests(c: httpx.Client) -> None:
    _, before = fetch_metrics(c)
    predicted = [_complete(c, n)["timings"]["predicted_n"] for n in (1, 4, 16)]
    _, after = fetch_metrics(c)
    grew = after["llamacpp:tokens_predicted_total"][1] - before["llamacpp:tokens_predicted_total"][1]
    assert grew == sum(predicted)


def test_the_generation_rate_gauge_leaves_out_each_first_token() -> None:
    """(test_metrics_generation_rate_excludes_first_token's meaning, on the gauge.) The first token
    comes from the last prompt batch's logits: 16 tokens in 30 ms are 15 decode steps."""
    stats = LlamaStats.empty()
    stats.add(prompt_n=4, prompt_ms=2.0, cache_n=0, predicted_n=1, predicted_ms=0.001, n_tokens=5)
    values = llamacpp_values(stats, {}, {}, 0)
    assert values["predicted_tokens_seconds"] == 0.0 and values["tokens_predicted_total"] == 1
    stats.add(prompt_n=4, prompt_ms=2.0, cache_n=3, predicted_n=16, predicted_ms=30.0, n_tokens=23)
    core = {"decodes": 20, "decode_busy_slots": 30}
    values = llamacpp_values(stats, core, {"slotkeeper_queue_waiting": 2.0}, 1)
    assert values["predicted_tokens_seconds"] == pytest.approx(15 / 0.030001)
    assert values["prompt_tokens_seconds"] == pytest.approx(8 / 0.004)
    assert (values["n_tokens_max"], values["prompt_tokens_cached_total"]) == (23, 3)
    assert (values["n_decode_total"], values["n_busy_slots_per_decode"]) == (20, 1.5)
    assert (values["requests_processing"], values["requests_deferred"]) == (1, 2)
    assert "llamacpp:n_busy_slots_per_decode 1.5\n" in llamacpp_text(values)
    assert "llamacpp:n_decode_total 20\n" in llamacpp_text(values)


def test_a_scrape_starts_the_gauges_window(c: httpx.Client) -> None:
    """llama-server averages its rate gauges over the window between two scrapes."""
    _complete(c, 8)
    _, first = fetch_metrics(c)
    assert first["llamacpp:predicted_tokens_seconds"][1] > 0
    _, second = fetch_metrics(c)  # nothing generated since
    assert second["llamacpp:predicted_tokens_seconds"][1] == 0
    assert second["llamacpp:tokens_predicted_total"] == first["llamacpp:tokens_predicted_total"]


# -- test_basic.py ----------------------------------------------------------------------------------
def test_server_model_aliases_and_tags(c: httpx.Client) -> None:
    (model,) = _ok(c.get("/models"))["data"]
    assert set(model["aliases"]) == {"tinyllama-2", "fim", "code"}
    assert set(model["tags"]) == {"chat", "fim", "small"}
    assert model["id"] == "code"  # the alphabetically first, as llama-server's sorted set
    assert parse_settings(["-m", "m.gguf", "-a", "b,a"], {}).model_id == "a"


# -- test_chat_completion.py: __verbose ---------------------------------------------------------------
def test_verbose_debug(c: httpx.Client) -> None:
    for verbose in (True, False):
        body = _ok(c.post("/chat/completions", json={"max_tokens": 2, "messages": BOOK, "verbose": verbose}))
        if not verbose:
            assert "__verbose" not in body
            continue
        debug = body["__verbose"]
        assert "Book" in debug["prompt"] and debug["prompt"].endswith("<|im_start|>assistant\n")
        assert debug["tokens_evaluated"] == body["usage"]["prompt_tokens"]
        assert debug["tokens_predicted"] == 2 and debug["content"] == body["choices"][0]["message"]["content"]
        assert debug["timings"] == body["timings"]


def test_verbose_on_streams_and_completions(c: httpx.Client) -> None:
    """A stream carries `__verbose` on its finishing chunk; /completion's result always has `prompt`,
    the prompt's tokens as text (special tokens spelled out)."""
    chunks = _sse(
        c, "/v1/chat/completions", {"max_tokens": 3, "messages": BOOK, "stream": True, "verbose": True}
    )
    (finish,) = [ch for ch in chunks if ch["choices"] and ch["choices"][0]["finish_reason"]]
    assert finish["__verbose"]["prompt"].endswith("<|im_start|>assistant\n")
    assert all("__verbose" not in ch for ch in chunks if ch is not finish)
    tokens = _ok(c.post("/tokenize", json={"content": "<|im_start|>user\nhi", "add_special": True}))["tokens"]
    result = _complete(c, 2, tokens)
    assert result["prompt"] == _ok(c.post("/detokenize", json={"tokens": tokens}))["content"]
    legacy = _ok(c.post("/v1/completions", json={"prompt": "I believe", "max_tokens": 2, "verbose": True}))
    assert legacy["__verbose"]["content"] == legacy["choices"][0]["text"]
    assert "I believe" in legacy["__verbose"]["prompt"]


# -- test_compat_anthropic.py ---------------------------------------------------------------------------
def test_anthropic_messages_streaming_counts_tokens(c: httpx.Client) -> None:
    events = _sse(
        c,
        "/v1/messages",
        {
            "model": "test",
            "max_tokens": 30,
            "stream": True,
            "messages": [{"role": "user", "content": "Say hello"}],
        },
    )
    start = next(e for e in events if e["type"] == "message_start")
    delta = next(e for e in events if e["type"] == "message_delta")
    assert start["message"]["usage"]["input_tokens"] > 0
    assert delta["usage"]["output_tokens"] > 0
    whole = delta["usage"]["input_tokens"] + delta["usage"]["cache_read_input_tokens"]
    assert start["message"]["usage"]["input_tokens"] == whole  # the prompt's size, split at the end
    assert "timings" not in next(e for e in events if e["type"] == "message_stop")


def test_anthropic_thinking_with_a_small_budget(c: httpx.Client) -> None:
    body = {
        "model": "test",
        "max_tokens": 100,
        "thinking": {"type": "enabled", "budget_tokens": 50},
        "messages": [{"role": "user", "content": "What is 2+2?"}],
    }
    assert _ok(c.post("/v1/messages", json=body))["type"] == "message"


def test_anthropic_empty_messages(c: httpx.Client) -> None:
    """An empty conversation renders the system prompt, if any, and the generation prompt (llama-server's
    upstream test sends no system prompt); the chat API itself still wants a message."""
    bare = _ok(c.post("/v1/messages", json={"model": "test", "max_tokens": 5, "messages": []}))
    assert bare["type"] == "message" and bare["usage"]["output_tokens"] > 0
    assert (
        _ok(c.post("/v1/messages/count_tokens", json={"model": "test", "messages": []}))["input_tokens"] > 0
    )
    r = c.post("/v1/chat/completions", json={"max_tokens": 5, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    body = {"model": "test", "max_tokens": 5, "system": "Be brief.", "messages": []}
    message = _ok(c.post("/v1/messages", json=body))
    assert message["type"] == "message" and message["usage"]["output_tokens"] > 0
    counted = _ok(
        c.post("/v1/messages/count_tokens", json={"model": "test", "system": "Be brief.", "messages": []})
    )
    assert (
        counted["input_tokens"]
        == message["usage"]["input_tokens"] + message["usage"]["cache_read_input_tokens"]
    )


@pytest.mark.parametrize("where", ["tool_result", "message"])
def test_anthropic_images_are_refused_with_llama_servers_words(c: httpx.Client, where: str) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": RED_PIXEL}}
    if where == "tool_result":
        messages = [
            {"role": "user", "content": "What is in this image?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "tool_1", "name": "read", "input": {}}],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "tool_1",
                        "content": [{"type": "text", "text": "File: test.png"}, image],
                    }
                ],
            },
        ]
        param = "messages[2].content[0].content[1]"
    else:
        messages = [{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}]
        param = "messages[0].content[0]"
    r = c.post("/v1/messages", json={"model": "test", "max_tokens": 10, "messages": messages})
    assert r.status_code == 400, r.text  # llama-server: 500 for a request no model here can serve
    error = r.json()["error"]
    assert "image input is not supported" in error["message"].lower() and param in error["message"]


# -- prompt progress: test_chat_completion.py, test_metrics.py, test_compat_oai_responses.py ----------
def _progress(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c["prompt_progress"] for c in chunks if "prompt_progress" in c]


def _check_reports(reports: list[dict[str, Any]], batch: int) -> None:
    """upstream test_return_progress's rules: the first report has cache == processed, all share
    total and cache, processed grows, the last has processed == total; one report per batch after
    the first."""
    assert reports and reports[0]["cache"] == reports[0]["processed"] and reports[0]["total"] > 0
    for before, after in zip(reports, reports[1:], strict=False):
        assert (after["total"], after["cache"]) == (before["total"], before["cache"])
        assert after["processed"] > before["processed"]
    assert reports[-1]["processed"] == reports[-1]["total"]
    evaluated = reports[-1]["total"] - reports[0]["cache"]
    assert len(reports) == 1 + -(-evaluated // batch), reports
    assert all(isinstance(r["time_ms"], int) and r["time_ms"] >= 0 for r in reports)


def test_return_progress(c: httpx.Client) -> None:
    """(test_chat_completion.py::test_return_progress) Cold, a report when the prompt starts and one
    per batch (-b 32); the same prompt again: the cache short of its last token, then that token, as
    llama-server counts it (it evaluates the last token again; we serve its stored logits)."""
    body = {
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "This is a progress test" * 10}],
        "stream": True,
        "return_progress": True,
        "id_slot": 1,
    }
    cold = _progress(_sse(c, "/chat/completions", {**body, "cache_prompt": False}))
    _check_reports(cold, 32)
    assert cold[0]["cache"] == 0 and len(cold) > 2
    chunks = _sse(c, "/chat/completions", body)
    again = _progress(chunks)
    _check_reports(again, 32)
    assert len(again) == 2 and again[0]["cache"] == again[0]["total"] - 1
    # llama-server's progress chunk: the assistant's role, before any content.
    first_content = next(
        i for i, ch in enumerate(chunks) if ch["choices"] and ch["choices"][0]["delta"].get("content")
    )
    for ch in chunks[:first_content]:
        assert ch["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert all("prompt_progress" not in ch for ch in chunks[first_content:])
    assert chunks[-1]["timings"]["cache_n"] == again[0]["total"]  # the timings keep what was served
    plain = _ok(c.post("/chat/completions", json={**body, "stream": False}))  # no stream: no effect
    assert "prompt_progress" not in plain


def test_metrics_timings_on_prompt_progress(c: httpx.Client) -> None:
    """(test_metrics.py::test_metrics_timings_on_prompt_progress) With `timings_per_token`, every
    progress chunk carries timings: zero before the first batch, never negative or null, prompt time
    never going back; the token chunks carry them too."""
    prompt = "the quick brown fox jumps over the lazy dog " * 8
    chunks = _sse(
        c,
        "/completion",
        {
            "prompt": prompt,
            "n_predict": 4,
            "stream": True,
            "timings_per_token": True,
            "return_progress": True,
            "cache_prompt": False,
        },
    )
    progress = [ch for ch in chunks if "prompt_progress" in ch]
    assert len(progress) > 1
    first = progress[0]["timings"]
    assert (first["prompt_n"], first["prompt_ms"], first["predicted_n"], first["predicted_ms"]) == (
        0,
        0.0,
        0,
        0.0,
    )
    prompt_ms = 0.0
    for ch in progress:
        assert all(v is not None and v >= 0 for v in ch["timings"].values()), ch
        assert ch["timings"]["prompt_ms"] >= prompt_ms
        prompt_ms = ch["timings"]["prompt_ms"]
    assert prompt_ms > 0
    tokens = [ch for ch in chunks if ch.get("tokens")]
    assert tokens and all("timings" in ch for ch in tokens)
    assert [ch["timings"]["predicted_n"] for ch in tokens] == list(range(1, len(tokens) + 1))
    plain = _sse(c, "/completion", {"prompt": prompt, "n_predict": 2, "stream": True})
    assert all("prompt_progress" not in ch and ("timings" not in ch or ch["stop"]) for ch in plain)


def test_responses_stream_with_llama_telemetry(c: httpx.Client) -> None:
    """(test_compat_oai_responses.py::test_responses_stream_with_llama_telemetry) Progress rides on
    `response.in_progress` events, text deltas carry timings, the last event the final ones."""
    events = _sse(
        c,
        "/responses",
        {
            "input": "This is a test" * 10,
            "max_output_tokens": 8,
            "temperature": 0.8,
            "stream": True,
            "timings_per_token": True,
            "return_progress": True,
            "cache_prompt": False,
        },
    )
    progress = [e for e in events if "prompt_progress" in e]
    assert len(progress) > 1 and all(e["type"] == "response.in_progress" for e in progress)
    assert all(e["prompt_progress"]["processed"] >= e["prompt_progress"]["cache"] for e in progress)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    timed = [e for e in deltas if "timings" in e]  # (text the parser held back to the end has none)
    assert timed and all("prompt_per_second" in e["timings"] for e in timed)
    # The last event carries the generation's timings; cut by max_output_tokens it is OpenAI's
    # `response.incomplete` (llama-server says `response.completed`: docs/llama-server.md).
    last = events[-1]
    assert last["type"] in ("response.completed", "response.incomplete")
    assert "usage" in last["response"] and "predicted_per_second" in last["timings"]
    seq = [e["sequence_number"] for e in events]
    assert seq == list(range(len(seq)))


def test_return_progress_on_messages_adds_nothing(c: httpx.Client) -> None:
    """llama-server's Messages stream shows no progress: the events are those of a plain stream."""
    body = {
        "model": "test",
        "max_tokens": 4,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Hi"}],
        "stream": True,
    }
    kinds = [e["type"] for e in _sse(c, "/v1/messages", {**body, "return_progress": True})]
    assert kinds == [e["type"] for e in _sse(c, "/v1/messages", body)]


# -- test_compat_oai_responses.py -----------------------------------------------------------------------
def test_responses_without_model(c: httpx.Client) -> None:
    response = _ok(c.post("/responses", json={"input": "This is a test" * 3, "max_output_tokens": 4}))
    assert response["status"] in ("completed", "incomplete") and response["model"] == "code"
    events = _sse(c, "/responses", {"input": "This is a test", "max_output_tokens": 4, "stream": True})
    (done,) = [e for e in events if e["type"] in ("response.completed", "response.incomplete")]
    assert done["response"]["usage"]["input_tokens"] > 0 and done["response"]["model"] == "code"


# -- test_ignore_eos.py ---------------------------------------------------------------------------------
def test_ignore_eos_populates_logit_bias(c: httpx.Client) -> None:
    """ignore_eos bans every end-of-generation token with a -inf bias (null in JSON), shown in the echo,
    over a bias the client gave; without it the echo holds only the client's."""
    banned = _complete(c, 8, "Once upon a time", ignore_eos=True, temperature=0.0)
    bias = banned["generation_settings"]["logit_bias"]
    assert bias and all(entry["bias"] is None for entry in bias)
    assert banned["tokens_predicted"] == 8
    eos = bias[0]["token"]
    again = _complete(c, 2, "Once upon a time", ignore_eos=True, logit_bias=[[eos, 5.0]])
    assert {"bias": None, "token": eos} in again["generation_settings"]["logit_bias"]
    plain = _complete(c, 2, "Once upon a time", ignore_eos=False, logit_bias=[[eos, 5.0]])
    assert plain["generation_settings"]["logit_bias"] == [{"bias": 5.0, "token": eos}]


# -- test_chat_completion.py: prefill with content parts ---------------------------------------------------
def test_prefill_joins_text_parts_by_a_blank_line(c: httpx.Client) -> None:
    """(test_chat_template_assistant_prefill[prefill1]) `[Wh, ill]` is continued as `Wh\\n\\nill`."""
    prefill = [{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}]
    for content, expected in (("Whill", "Whill"), (prefill, "Wh\n\nill")):
        messages = [*BOOK, {"role": "assistant", "content": content}]
        prompt = _ok(c.post("/apply-template", json={"messages": messages}))["prompt"]
        assert prompt.endswith("What is the best book<|im_end|>\n<|im_start|>assistant\n" + expected)
        verbose = _ok(
            c.post("/chat/completions", json={"max_tokens": 2, "messages": messages, "verbose": True})
        )
        assert verbose["__verbose"]["prompt"].endswith(prompt)  # (with the BOS text)


# -- header names (test_security.py::test_cors_options, test_metrics.py) -------------------------------
def _raw_head(engine: EngineProcess, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", engine.port), timeout=30) as s:
        s.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(4096)
            assert chunk, data
            data += chunk
    return data.split(b"\r\n\r\n", 1)[0]


def test_header_names_leave_in_llama_servers_case(engine: EngineProcess) -> None:
    """The bytes on the wire, not a case-insensitive view of them: llama-server's suite reads
    `Process-Start-Time-Unix` and `Access-Control-Allow-*` from a plain dict."""
    head = _raw_head(engine, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"\r\nProcess-Start-Time-Unix: " in head and b"\r\nContent-Type: text/plain" in head
    preflight = (
        b"OPTIONS /completions HTTP/1.1\r\nHost: x\r\nOrigin: http://web.mydomain.fr\r\n"
        b"Access-Control-Request-Method: POST\r\nConnection: close\r\n\r\n"
    )
    head = _raw_head(engine, preflight)
    for line in (
        b"Access-Control-Allow-Origin: http://web.mydomain.fr",
        b"Access-Control-Allow-Credentials: true",
        b"Access-Control-Allow-Methods: GET, POST, DELETE, OPTIONS",
        b"Access-Control-Allow-Headers: *",
    ):
        assert b"\r\n" + line + b"\r\n" in head + b"\r\n", head


def test_canonical_head_touches_names_only() -> None:
    head = b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain\r\nwww-authenticate: Bearer\r\n\r\n"
    body = b"x-not-a-header: value\r\n\r\n"
    assert canonical_head(head + body) == (
        b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nWWW-Authenticate: Bearer\r\n\r\n" + body
    )
    assert canonical_name(b"x-session-id") == b"X-Session-Id"
    assert canonical_head(b"not a head") == b"not a head"


# -- test_compat_gcp.py -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vertex(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """An engine run as a Vertex AI container (`AIP_MODE=PREDICTION`), its route renamed."""
    env = {"AIP_MODE": "PREDICTION", "AIP_PREDICT_ROUTE": "/v1/predict-here"}
    log = tmp_path_factory.mktemp("vertex") / "engine.log"
    eng = EngineProcess(models["llama"], "-np", "2", "-c", "512", log_path=log, env=env).start()
    try:
        yield eng
    finally:
        assert eng.stop() == 0, eng.log()[-4000:]


def test_gcp_predict(vertex: EngineProcess, engine: EngineProcess) -> None:
    """(test_gcp_predict_camel_case, test_gcp_predict_multiple_instances) Each instance is a chat
    completion, answered in order; the route exists only in prediction mode."""
    instance = {"@requestFormat": "chatCompletions", "max_tokens": 8}
    says = ["Say hello", "Say world"]
    body = {"instances": [{**instance, "messages": [{"role": "user", "content": s}]} for s in says]}
    with httpx.Client(base_url=vertex.url, timeout=60.0) as v:
        predictions = _ok(v.post("/v1/predict-here", json=body))["predictions"]
        assert len(predictions) == 2
        for p in predictions:
            assert p["object"] == "chat.completion" and p["choices"][0]["message"]["role"] == "assistant"
            assert len(p["choices"][0]["message"]["content"]) > 0
        refusals = [
            ({"instances": []}, "instances"),
            ({"instances": [{"max_tokens": 8, "messages": BOOK}]}, "instances[0].@requestFormat"),
            ({"instances": [{**instance, "messages": BOOK, "stream": True}]}, "instances[0].stream"),
            (
                {"instances": [{**instance, "messages": BOOK}, {**instance, "messages": []}]},
                "instances[1].messages",
            ),
        ]
        for refused, param in refusals:
            r = v.post("/v1/predict-here", json=refused)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert v.post("/predict", json=body).status_code == 404
    with httpx.Client(base_url=engine.url, timeout=60.0) as c:
        assert c.post("/predict", json=body).status_code == 404


def test_vertex_variables() -> None:
    on = {"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "9123"}
    settings = parse_settings(["-m", "m.gguf", "--port", "8080"], on)
    assert (settings.predict_route, settings.port) == ("/predict", 9123)
    assert parse_settings(["-m", "m.gguf"], {"AIP_HTTP_PORT": "9123"}).predict_route is None
    with pytest.raises(SettingsError, match="AIP_PREDICT_ROUTE"):
        parse_settings(["-m", "m.gguf"], {**on, "AIP_PREDICT_ROUTE": "predict"})

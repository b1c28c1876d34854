"""llama-server's request features and response shapes, against a real engine and in pure parts.

Timings are numbers only, with how the prefix was reused beside them (`slotkeeper`); the first chat
delta is `{"role": "assistant", "content": null}`; `n_probs` / `logprobs` come back in llama-server's
and OpenAI's shapes, streamed too; `logit_bias` takes texts; prompts come as arrays, mixes and
`{"prompt_string": ...}` objects; `n` choices; a top-level `json_schema`; `response_fields`;
`/chat/completions/input_tokens`; assistant prefill and `continue_final_message` by llama-server's
rules. What this engine does not do is refused with a 400 that names the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from engine_pool.errors import BadRequest
from engine_pool.http.body import Body
from engine_pool.server.chat_request import continuation, continued_open, message_text
from engine_pool.server.completion_prompts import split_prompts
from engine_pool.server.completion_result import select_fields
from engine_pool.server.decoding import (
    Outcome,
    TokenProb,
    completion_logprobs,
    probs_json,
    reuse_dict,
    timings_dict,
)
from engine_pool.server.openai_answer import usage
from engine_pool.server.sampling import Sampling, read_logit_bias, resolve_text_bias
from gateway.turn.engine_call import StreamRelay

from ..conftest import EngineProcess

TIMINGS = {
    "cache_n",
    "prompt_n",
    "prompt_ms",
    "prompt_per_token_ms",
    "prompt_per_second",
    "predicted_n",
    "predicted_ms",
    "predicted_per_token_ms",
    "predicted_per_second",
}
USER = [{"role": "user", "content": "Tell me about the slot cache."}]
CHAT = "/v1/chat/completions"


@pytest.fixture
def client(llama_engine: EngineProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{llama_engine.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _ok(r: httpx.Response) -> Any:
    assert r.status_code == 200, r.text
    return r.json()


def _refused(r: httpx.Response, param: str, words: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def _events(c: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with c.stream("POST", path, json=body) as s:
        assert s.status_code == 200, s.read()
        return [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]


def _numeric(timings: dict[str, Any]) -> None:
    assert set(timings) == TIMINGS, timings
    assert all(isinstance(v, int | float) and not isinstance(v, bool) for v in timings.values()), timings


def _reuse(extra: dict[str, Any]) -> None:
    assert extra["reuse"] in ("live", "checkpoint", "logits", "none") and isinstance(extra["restored"], bool)


# -- response shapes ----------------------------------------------------------------------------
def test_timings_are_numbers_and_the_reuse_facts_sit_beside_them(llama: httpx.Client) -> None:
    done = _ok(llama.post("/completion", json={"prompt": "Hello", "n_predict": 3}))
    _numeric(done["timings"])
    _reuse(done["slotkeeper"])
    streamed = _events(llama, "/completion", {"prompt": "Hello", "n_predict": 3, "stream": True})
    _numeric(streamed[-1]["timings"])
    _reuse(streamed[-1]["slotkeeper"])
    chat = _ok(llama.post(CHAT, json={"messages": USER, "max_tokens": 3}))
    _numeric(chat["timings"])
    _reuse(chat["slotkeeper"])
    chunks = _events(
        llama,
        CHAT,
        {"messages": USER, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
    )
    for last in chunks[-2:]:  # the finish chunk and the usage chunk
        _numeric(last["timings"])
        _reuse(last["slotkeeper"])
    legacy = _ok(llama.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}))
    _numeric(legacy["timings"])
    _numeric(legacy["choices"][0]["timings"])
    _reuse(legacy["slotkeeper"])


def test_the_first_chat_delta_opens_the_assistant_message_with_null_content(
    llama: httpx.Client, client: openai.OpenAI
) -> None:
    chunks = _events(llama, CHAT, {"messages": USER, "max_tokens": 2, "stream": True})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    first = next(iter(client.chat.completions.create(model="m", messages=USER, max_tokens=2, stream=True)))
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content is None


def test_rates_follow_llama_server() -> None:
    """1e3 / ms * n, with llama-server's 1 µs floor; generation over its decode steps (n - 1: the
    first token comes from the prompt's logits, upstream test_metrics_generation_rate_excludes_first_token),
    so one token reports 0; nothing generated (or nothing evaluated) reports 0."""

    def timings(**kw: Any) -> Any:
        base = dict(prompt_n=0, cache_n=0, predicted_n=0, prompt_ms=0.0, predicted_ms=0.0)
        facts = {
            "reuse": "none",
            "restored": False,
            "checkpoints_created": 0,
            "source_slot": -1,
            "candidate_slot": -1,
            "candidate_n": 0,
            "candidate_prompt_n": 0,
            "common_n": 0,
        }
        return SimpleNamespace(**(base | facts | kw))

    one = timings_dict(timings(prompt_n=4, prompt_ms=1.5, predicted_n=1, predicted_ms=0.5))
    assert (one["predicted_ms"], one["predicted_per_token_ms"], one["predicted_per_second"]) == (
        0.001,
        0.0,
        0.0,
    )
    assert (one["prompt_ms"], one["prompt_per_token_ms"], one["prompt_per_second"]) == (2.0, 0.5, 2000.0)
    many = timings_dict(timings(predicted_n=10, predicted_ms=40.0))
    assert (
        many["predicted_per_second"] == pytest.approx(1e3 / 40.0 * 9)
        and many["predicted_per_token_ms"] == 40 / 9
    )
    none = timings_dict(timings(cache_n=7, prompt_ms=0.3))
    assert none["prompt_per_second"] == none["predicted_per_second"] == 0.0 and none["cache_n"] == 7
    assert reuse_dict(timings(reuse="logits", restored=True)) == {
        "reuse": "logits",
        "restored": True,
        "checkpoints_created": 0,
    }
    copied = reuse_dict(
        timings(
            reuse="checkpoint",
            source_slot=2,
            candidate_slot=2,
            candidate_n=90,
            candidate_prompt_n=80,
            common_n=64,
        )
    )
    assert copied["source_slot"] == 2
    assert copied["prefix"] == {"slot": 2, "tokens": 90, "prompt_tokens": 80, "common": 64}


# -- probabilities ------------------------------------------------------------------------------
def test_n_probs_on_completion_streamed_or_not(llama: httpx.Client) -> None:
    body = {"prompt": "The slot cache", "n_predict": 5, "temperature": 0, "ignore_eos": True, "n_probs": 3}
    done = _ok(llama.post("/completion", json=body))
    probs = done["completion_probabilities"]
    assert [p["id"] for p in probs] == done["tokens"]
    for p in probs:
        assert set(p) == {"id", "token", "bytes", "logprob", "top_logprobs"} and p["logprob"] <= 0
        top = p["top_logprobs"]
        assert len(top) == 3 and [t["logprob"] for t in top] == sorted(
            (t["logprob"] for t in top), reverse=True
        )
        assert top[0]["id"] == p["id"] and top[0]["logprob"] == pytest.approx(
            p["logprob"]
        )  # greedy: the best
        assert bytes(p["bytes"]).decode("utf-8", "ignore") == p["token"]
    events = _events(llama, "/completion", {**body, "stream": True})
    streamed = [p for e in events[:-1] for p in e.get("completion_probabilities", [])]
    assert streamed == probs and "completion_probabilities" not in events[-1]
    _refused(llama.post("/completion", json={**body, "n_probs": 101}), "n_probs", "within 0..100")
    post = llama.post("/completion", json={**body, "post_sampling_probs": True})
    _refused(post, "post_sampling_probs", "raw logits")


def test_chat_logprobs_through_the_openai_client(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "m", "messages": USER, "max_tokens": 6, "temperature": 0, "seed": 1}
    plain = client.chat.completions.create(**kwargs)
    assert plain.choices[0].logprobs is None
    r = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2, extra_body={"id_slot": 0})
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and r.usage is not None and len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 and t.bytes is not None for t in content)
    assert "".join(t.token for t in content) == r.choices[0].message.content
    bare = client.chat.completions.create(**kwargs, logprobs=True)  # OpenAI's default: no alternatives
    assert all(t.top_logprobs == [] for t in bare.choices[0].logprobs.content or [])  # type: ignore[union-attr]
    chunks = list(
        client.chat.completions.create(
            **kwargs, logprobs=True, top_logprobs=2, stream=True, extra_body={"id_slot": 0}
        )
    )
    streamed = [
        t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content or []
    ]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(**kwargs, top_logprobs=2)
    assert "top_logprobs requires logprobs to be set to true" in str(exc.value)


def test_legacy_completions_logprobs(client: openai.OpenAI, llama: httpx.Client) -> None:
    r = client.completions.create(model="m", prompt="The slot cache", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert (
        lp is not None
        and lp.tokens is not None
        and lp.token_logprobs is not None
        and lp.top_logprobs is not None
    )
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) <= 2 for t in lp.top_logprobs) and "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    chunks = _events(
        llama,
        "/v1/completions",
        {"prompt": "The slot cache", "max_tokens": 4, "temperature": 0, "logprobs": 2, "stream": True},
    )
    tokens = [
        t
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for t in c["choices"][0]["logprobs"]["tokens"]
    ]
    offsets = [
        o
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for o in c["choices"][0]["logprobs"]["text_offset"]
    ]
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_probability_shapes() -> None:
    probs = [TokenProb(5, -0.5, ((5, -0.5), (6, -math.inf))), TokenProb(6, -1.0, ((7, -0.2), (6, -1.0)))]
    pieces = {5: b"ab", 6: b"\xe2\x82", 7: b"c"}.__getitem__
    out = probs_json(probs, pieces)
    assert out[0] == {
        "id": 5,
        "token": "ab",
        "bytes": [97, 98],
        "logprob": -0.5,
        "top_logprobs": [
            {"id": 5, "token": "ab", "bytes": [97, 98], "logprob": -0.5},
            {
                "id": 6,
                "token": "",
                "bytes": [226, 130],
                "logprob": -3.4028234663852886e38,
            },  # JSON has no -inf
        ],
    }
    assert len(probs_json(probs, pieces, 1)[1]["top_logprobs"]) == 1
    legacy = completion_logprobs(probs, pieces, 1, offset=10)
    assert legacy["tokens"] == ["ab", ""] and legacy["text_offset"] == [10, 12]
    assert legacy["top_logprobs"] == [{"ab": -0.5}, {"c": -0.2}] and legacy["token_logprobs"] == [-0.5, -1.0]


# -- logit_bias by text -------------------------------------------------------------------------
def _single_token_text(c: httpx.Client) -> tuple[str, int]:
    """A word of the vocabulary that tokenizes back to one token."""
    for word in ("the", " the", "hello", " world", "cache", " cache"):
        tokens = _ok(c.post("/tokenize", json={"content": word, "parse_special": False}))["tokens"]
        if len(tokens) == 1:
            return word, tokens[0]
    raise AssertionError("no single-token word in the tiny vocabulary")


def test_logit_bias_keyed_by_text(llama: httpx.Client) -> None:
    word, token = _single_token_text(llama)
    body: dict[str, Any] = {"prompt": "Hello there", "n_predict": 3, "temperature": 0, "ignore_eos": True}
    for bias in ({word: 100}, [[word, 100]]):
        assert _ok(llama.post("/completion", json={**body, "logit_bias": bias}))["tokens"] == [token] * 3
    banned = _ok(llama.post("/completion", json={**body, "n_predict": 8, "logit_bias": {word: False}}))
    assert token not in banned["tokens"]
    chat = _ok(
        llama.post(
            CHAT, json={"messages": USER, "max_tokens": 2, "temperature": 0, "logit_bias": {word: 100}}
        )
    )
    assert chat["choices"][0]["message"]["content"] == word * 2
    _refused(
        llama.post("/completion", json={**body, "logit_bias": {"": 1}}), "logit_bias", "neither a token id"
    )


def test_logit_bias_forms_unit() -> None:
    by_id, by_text = read_logit_bias(Body({"logit_bias": {"12": 1.5, "hi": False, " 3": -1}}), 100, 10)
    assert by_id == {12: 1.5, 3: -1.0} and by_text == (("hi", -math.inf),)
    by_id, by_text = read_logit_bias(Body({"logit_bias": [[7, False], ["a b", 2]]}), 100, 10)
    assert by_id == {7: -math.inf} and by_text == (("a b", 2.0),)
    with pytest.raises(BadRequest, match="outside the vocabulary"):
        read_logit_bias(Body({"logit_bias": {"100": 1}}), 100, 10)
    with pytest.raises(BadRequest, match="characters of text in its keys"):
        read_logit_bias(Body({"logit_bias": {"abcd": 1}}), 100, 10, max_chars=3)
    s = Sampling(logit_bias={1: 1.0}, logit_bias_text=(("a b", -2.0),))
    resolved = resolve_text_bias(s, lambda text: [ord(ch) for ch in text], max_entries=4)
    assert resolved.logit_bias == {1: 1.0, 97: -2.0, 32: -2.0, 98: -2.0} and resolved.logit_bias_text == ()
    with pytest.raises(BadRequest, match="biases 4 tokens"):
        resolve_text_bias(s, lambda text: [ord(ch) for ch in text], max_entries=3)


# -- prompts ------------------------------------------------------------------------------------
def test_prompt_forms(llama: httpx.Client) -> None:
    body: dict[str, Any] = {"n_predict": 3, "temperature": 0, "ignore_eos": True, "id_slot": 0}
    text = _ok(llama.post("/completion", json={**body, "prompt": "Hello world"}))
    ids = _ok(llama.post("/tokenize", json={"content": "Hello world", "add_special": True}))["tokens"]
    for same in (ids, {"prompt_string": "Hello world"}, {"prompt_string": [ids[0], "Hello world"][1:]}):
        assert _ok(llama.post("/completion", json={**body, "prompt": same}))["content"] == text["content"]
    several = _ok(
        llama.post(
            "/completion",
            json={**body, "id_slot": -1, "prompt": ["Hello world", ids, {"prompt_string": "x"}]},
        )
    )
    assert isinstance(several, list) and [r["index"] for r in several] == [0, 1, 2]
    assert several[0]["content"] == several[1]["content"] == text["content"]
    media = {"prompt_string": "<__media__>", "multimodal_data": ["aGVsbG8="]}
    _refused(
        llama.post("/completion", json={**body, "prompt": media}), "prompt.multimodal_data", "multimodal"
    )
    _refused(
        llama.post("/completion", json={**body, "prompt": ["a", media]}),
        "prompt[1].multimodal_data",
        "text-only",
    )
    _refused(
        llama.post("/completion", json={**body, "prompt": {"text": "a"}}), "prompt", "this object has none"
    )
    legacy = _ok(
        llama.post(
            "/v1/completions",
            json={
                "prompt": {"prompt_string": "Hello world"},
                "max_tokens": 3,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
    )
    assert legacy["choices"][0]["text"] == text["content"]
    streamed = llama.post("/completion", json={**body, "prompt": ["a", "b"], "stream": True})
    _refused(streamed, "prompt", "exactly one prompt")


def test_split_prompts() -> None:
    assert split_prompts("a") == ["a"]
    assert split_prompts([1, 2, "a"]) == [[1, 2, "a"]]  # a number at the top level: one mixed prompt
    assert split_prompts(["a", [1, 2], {"prompt_string": "b"}]) == ["a", [1, 2], {"prompt_string": "b"}]
    with pytest.raises(BadRequest, match="must not be empty"):
        split_prompts([])


# -- several choices ----------------------------------------------------------------------------
def test_n_choices(client: openai.OpenAI, llama: httpx.Client) -> None:
    r = client.chat.completions.create(model="m", messages=USER, max_tokens=4, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy: the same text
    assert r.usage is not None and r.usage.completion_tokens == 8
    single = client.chat.completions.create(model="m", messages=USER, max_tokens=4, temperature=0)
    assert single.usage is not None and r.usage.prompt_tokens == single.usage.prompt_tokens  # counted once
    assert all("timings" in (c.model_extra or {}) for c in r.choices) and "timings" not in (
        r.model_extra or {}
    )
    legacy = client.completions.create(model="m", prompt=["Hello", "World"], max_tokens=2, temperature=0, n=2)
    assert [c.index for c in legacy.choices] == [0, 1, 2, 3]
    assert (
        legacy.choices[0].text == legacy.choices[1].text and legacy.choices[2].text == legacy.choices[3].text
    )
    cmpl = _ok(
        llama.post("/completion", json={"prompt": "Hello", "n_predict": 2, "temperature": 0, "n_cmpl": 2})
    )
    assert len(cmpl) == 2 and cmpl[0]["content"] == cmpl[1]["content"]
    _refused(
        llama.post(CHAT, json={"messages": USER, "n": 2, "stream": True}), "n", "not supported with 'stream'"
    )
    _refused(llama.post(CHAT, json={"messages": USER, "n": 1000}), "n", "within 1..")
    _refused(
        llama.post("/v1/completions", json={"prompt": "a", "n": 2, "stream": True}), "n", "exactly one prompt"
    )


def test_usage_counts_a_prompt_once_per_choice_group() -> None:
    def outcome(n_prompt: int, cache_n: int, predicted: int) -> Outcome:
        return Outcome("", [], 0, n_prompt, "limit", "", {"cache_n": cache_n, "predicted_n": predicted})

    u = usage([outcome(10, 4, 2), outcome(10, 0, 3), outcome(7, 7, 1), outcome(7, 1, 1)], n=2)
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (17, 7, 24)
    assert u["prompt_tokens_details"]["cached_tokens"] == 11


# -- output constraints and result fields -------------------------------------------------------
def test_top_level_json_schema_constrains_chat(client: openai.OpenAI, llama: httpx.Client) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model="m", messages=USER, max_tokens=40, temperature=0.8, seed=2, extra_body={"json_schema": schema}
    )
    assert set(json.loads(r.choices[0].message.content or "")) == {"n"}
    both = {"messages": USER, "json_schema": schema, "grammar": 'root ::= "a"'}
    _refused(llama.post(CHAT, json=both), "json_schema", "Cannot use both json_schema and grammar")
    rf = {"messages": USER, "json_schema": schema, "response_format": {"type": "json_object"}}
    _refused(llama.post(CHAT, json=rf), "json_schema", "send one")
    deep = {"messages": USER, "json_schema": {"type": "string", "pattern": "a+"}}
    _refused(llama.post(CHAT, json=deep), "json_schema", "pattern")
    _refused(
        llama.post("/completion", json={"prompt": "a", "json_schema": schema, "grammar": 'root ::= "a"'}),
        "json_schema",
        "both",
    )


def test_response_fields(llama: httpx.Client) -> None:
    body = {
        "prompt": "Hello",
        "n_predict": 2,
        "response_fields": ["content", "generation_settings/n_predict", "no/such"],
    }
    assert set(_ok(llama.post("/completion", json=body))) == {"content", "generation_settings/n_predict"}
    events = _events(llama, "/completion", {**body, "stream": True})
    assert (
        set(events[-1]) == {"content", "generation_settings/n_predict"}
        and events[-1]["generation_settings/n_predict"] == 2
    )
    result = {"a": 1, "b": {"c": 2, "d": {"e": 3}}}
    assert select_fields(result, ["b/d/e", "b/c", "a", "b/x", "a/b"]) == {"b/d/e": 3, "b/c": 2, "a": 1}


def test_return_progress_on_openai_completions(llama: httpx.Client) -> None:
    """/v1/completions streams llama-server's progress chunks too (an empty choice beside the
    report); a plain answer ignores the field, as llama-server does."""
    body = {"prompt": "Hello there, progress " * 6, "max_tokens": 2, "return_progress": True}
    chunks = _events(llama, "/v1/completions", {**body, "stream": True, "cache_prompt": False})
    reports = [c for c in chunks if "prompt_progress" in c]
    assert (
        len(reports) >= 2
        and reports[-1]["prompt_progress"]["processed"] == reports[-1]["prompt_progress"]["total"]
    )
    assert all(c["choices"][0]["text"] == "" and c["choices"][0]["finish_reason"] is None for c in reports)
    assert "prompt_progress" not in _ok(llama.post("/v1/completions", json=body))


# -- counting and prefill -----------------------------------------------------------------------
def test_input_tokens_counts_what_the_chat_would_evaluate(llama: httpx.Client) -> None:
    body = {"messages": USER, "max_tokens": 1}
    chat = _ok(llama.post(CHAT, json=body))
    for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
        assert _ok(llama.post(path, json=body)) == {"input_tokens": chat["usage"]["prompt_tokens"]}
    _refused(llama.post("/v1/chat/completions/input_tokens", json={"messages": []}), "messages", "non-empty")


def test_assistant_prefill_and_continue_final_message(llama: httpx.Client) -> None:
    prefill = [*USER, {"role": "assistant", "content": "Sure, the cache"}]
    prompt = _ok(llama.post("/apply-template", json={"messages": prefill}))["prompt"]
    assert prompt.endswith("<|im_start|>assistant\nSure, the cache")  # continued: no end of turn
    explicit = {"messages": prefill, "continue_final_message": True, "add_generation_prompt": False}
    assert _ok(llama.post("/apply-template", json=explicit))["prompt"] == prompt
    chat = _ok(llama.post(CHAT, json={**explicit, "max_tokens": 2}))
    n_prompt = len(_ok(llama.post("/tokenize", json={"content": prompt, "add_special": True}))["tokens"])
    assert chat["usage"]["prompt_tokens"] == n_prompt
    assert _ok(llama.post("/v1/chat/completions/input_tokens", json=explicit))["input_tokens"] == n_prompt
    both = {"messages": prefill, "continue_final_message": True}  # add_generation_prompt defaults to true
    _refused(llama.post(CHAT, json=both), "continue_final_message", "Cannot set both add_generation_prompt")
    twice = [*prefill, {"role": "assistant", "content": "again"}]
    _refused(
        llama.post(CHAT, json={"messages": twice}), "messages", "Cannot have 2 or more assistant messages"
    )
    calls = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
    ]
    continued_call = {"messages": calls, "continue_final_message": True, "add_generation_prompt": False}
    _refused(llama.post(CHAT, json=continued_call), "messages", "contains tool calls")
    # Without the flag, a last tool call is a finished turn (llama-server refuses that too).
    new_turn = _ok(llama.post("/apply-template", json={"messages": calls}))["prompt"]
    assert new_turn.endswith("</tool_call><|im_end|>\n<|im_start|>assistant\n")
    no_gen = _ok(llama.post("/apply-template", json={"messages": USER, "add_generation_prompt": False}))[
        "prompt"
    ]
    assert no_gen.endswith("<|im_end|>\n")


def test_continuation_rules() -> None:
    user, bot = {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}
    assert continuation([user], True, None) == (False, True)
    assert continuation([user], False, False) == (False, False)
    assert continuation([user, bot], True, None) == (True, False)  # prefill, whatever the flag says
    assert continuation([user, bot], False, True) == (True, False)
    assert continuation([user, bot], False, "content") == (True, False)
    assert continuation([user, {**bot, "tool_calls": [{"id": "c"}]}], True, None) == (False, True)
    for messages, flag, cont, words in (
        ([user, bot], True, True, "Cannot set both"),
        ([user], False, True, "must be the assistant's"),
        ([user, bot, bot], True, None, "Cannot have 2 or more"),
        ([user, bot], False, "reasoning_content", "not supported"),
        ([user, bot], False, 3, "must be a boolean"),
        ([user, {**bot, "tool_calls": [{"id": "c"}]}], False, True, "contains tool calls"),
    ):
        with pytest.raises(BadRequest, match=words):
            continuation(messages, flag, cont)
    assert message_text({"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}) == "ab"
    assert continued_open("...<|im_start|>assistant\n<think>\n", "Let me") is True
    assert continued_open("...<think>\n", "x</think>\n\nAnswer") is False
    assert continued_open("...assistant\n", "Answer") is False


# -- the gateway relays the same fields ---------------------------------------------------------
def test_the_relay_reads_numeric_timings_and_follows_the_first_choice() -> None:
    relay = StreamRelay(SimpleNamespace())  # type: ignore[arg-type]  # no response is read here
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]},
        {"choices": [{"index": 1, "delta": {"content": "other"}}]},
        {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": "stop"}]},
        {
            "choices": [],
            "timings": {"prompt_n": 3, "cache_n": 9},
            "slotkeeper": {"reuse": "live", "restored": True},
        },
    ]
    relay._observe(
        b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    )
    out = relay.outcome
    assert (out.content, out.ok, out.timings["cache_n"]) == ("Hi", True, 9)

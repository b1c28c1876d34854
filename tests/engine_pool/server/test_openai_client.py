"""The official `openai` client against a real engine process: chat, streams, usage, tools, JSON output."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from ..conftest import EngineProcess

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME: Any = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}}, "required": ["tz"]},
    },
}
MESSAGES: list[Any] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
]


@pytest.fixture
def client(qwen_engine: EngineProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{qwen_engine.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_models_lists_the_alias(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny-qwen"]


def test_chat_non_stream(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny-qwen", messages=MESSAGES, max_tokens=8, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert r.usage is not None
    assert r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    extra = r.model_extra or {}
    assert extra["timings"]["prompt_n"] + extra["timings"]["cache_n"] == r.usage.prompt_tokens
    assert r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.cached_tokens == extra["timings"]["cache_n"]


def test_chat_stream_matches_non_stream_and_reports_usage(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": "tiny-qwen",
        "messages": MESSAGES,
        "max_tokens": 10,
        "temperature": 0,
        "extra_body": {"id_slot": 0},
    }
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert len({c.id for c in chunks}) == 1
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and (finals[0].model_extra or {})["timings"]["predicted_n"] >= 1
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    # The second request on slot 0 continues the first one's prompt: everything but the end is cached.
    assert usage_chunk.usage.prompt_tokens_details is not None
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens == usage_chunk.usage.prompt_tokens


def test_stream_without_usage_has_no_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3, stream=True))
    assert all(c.choices for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"


@pytest.mark.parametrize(
    "tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"]
)
def test_forced_tool_call(client: openai.OpenAI, tool_choice: Any) -> None:
    r = client.chat.completions.create(
        model="tiny-qwen",
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        max_tokens=250,
        temperature=0.7,
        seed=3,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    fn = call.function  # type: ignore[union-attr]
    args = json.loads(fn.arguments)
    if tool_choice == "required":
        assert fn.name in ("get_weather", "get_time")
    else:
        assert fn.name == "get_weather"
    if fn.name == "get_weather":
        assert set(args) >= {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
        assert isinstance(args["city"], str)


def test_forced_tool_call_streamed_as_fragments(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny-qwen",
        messages=MESSAGES,
        tools=[WEATHER],
        max_tokens=250,
        stream=True,
        temperature=0.7,
        seed=5,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        for tc in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += tc.id or ""
            if tc.function is not None:
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"])["unit"] in ("celsius", "fahrenheit")


def test_tool_choice_auto_parses_a_call_the_model_writes(client: openai.OpenAI) -> None:
    # A random model never calls a tool on its own; llama-server's `grammar` field makes it.
    call = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "utc"}}\n</tool_call>'
    grammar = "root ::= " + json.dumps(call)
    r = client.chat.completions.create(
        model="m", messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=200, extra_body={"grammar": grammar}
    )
    calls = r.choices[0].message.tool_calls
    assert calls is not None and calls[0].function.name == "get_time"  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments) == {"tz": "utc"}  # type: ignore[union-attr]
    assert r.choices[0].message.content is None


def test_a_stop_string_is_reported_as_the_stopping_word(client: openai.OpenAI) -> None:
    # llama-server's `stopping_word`, which the Messages API turns into `stop_sequence`.
    kwargs: dict[str, Any] = {
        "model": "m",
        "messages": MESSAGES,
        "max_tokens": 30,
        "stop": ["STOP"],
        "extra_body": {"grammar": 'root ::= "Hello STOP world"'},
    }
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert (choice.message.content, choice.finish_reason) == ("Hello ", "stop")
    assert (choice.model_extra or {})["stopping_word"] == "STOP"
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    finals = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and (finals[0].model_extra or {})["stopping_word"] == "STOP"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello "
    unstopped = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2).choices[0]
    assert "stopping_word" not in (unstopped.model_extra or {})


def test_json_schema_output_parses(client: openai.OpenAI) -> None:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer"},
            "admin": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["name", "age", "admin"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=120,
        temperature=0.8,
        seed=1,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": schema, "strict": True},
        },
    )
    data = json.loads(r.choices[0].message.content or "")
    assert set(data) >= {"name", "age", "admin"} and set(data) <= set(schema["properties"])
    assert isinstance(data["age"], int) and isinstance(data["admin"], bool) and isinstance(data["name"], str)


def test_json_object_output_is_an_object(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert r.choices[0].message.content is not None and r.choices[0].message.content.startswith("{")


def test_completions_endpoint_with_several_prompts(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model="m", prompt=["Hello world", "The model state"], max_tokens=4, temperature=0
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage is not None and r.usage.completion_tokens == 8
    chunks = list(
        client.completions.create(model="m", prompt="Hello world", max_tokens=4, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_error_shape_reaches_the_sdk(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="m", messages=[], max_tokens=2)
    assert "messages" in str(exc.value)
    body = exc.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error"

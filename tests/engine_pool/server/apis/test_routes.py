"""The engine's /v1/responses and /v1/messages with the real clients — openai (and the OpenAI Agents
SDK) and anthropic — against a tiny random-weight model behind an API key. Random weights write
random text, so tool calls are forced with tool_choice and lengths bounded with max tokens."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import agents
import anthropic
import httpx
import openai
import pytest
from support.weather_agent import weather_agent

from ...conftest import EngineProcess
from .conftest import API_KEY

QUESTION = "What is the weather in Paris?"
SYSTEM = "You are a helpful assistant. Answer briefly and use tools when they help."
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
}
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": PARAMETERS,
}
STRICT_WEATHER: Any = {**WEATHER, "strict": True}
ANTHROPIC_WEATHER: Any = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": PARAMETERS,
}


def text_of(message: anthropic.types.Message) -> str:
    [block] = message.content
    assert block.type == "text"
    return block.text


@pytest.fixture
def oai(keyed_engine: EngineProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{keyed_engine.url}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


@pytest.fixture
def claude(keyed_engine: EngineProcess) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=keyed_engine.url, api_key=API_KEY, max_retries=0) as c:
        yield c


# -- Responses ----------------------------------------------------------------------------------
def test_forced_function_call_then_its_output_is_served_from_the_cache(oai: openai.OpenAI) -> None:
    first = oai.responses.create(
        model="tiny-qwen",
        instructions=SYSTEM,
        input=QUESTION,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=250,
        temperature=0,
        extra_body={"id_slot": 0},  # an engine option, passed through to the chat path
    )
    assert first.status == "completed" and first.id.startswith("resp_")
    [call] = [i for i in first.output if i.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    assert isinstance(json.loads(call.arguments)["city"], str)
    follow = oai.responses.create(
        model="tiny-qwen",
        instructions=SYSTEM,
        input=[
            {"role": "user", "content": QUESTION},
            call.model_dump(exclude_none=True),  # type: ignore[list-item]
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
        ],
        tools=[WEATHER],
        max_output_tokens=4,
        temperature=0,
        extra_body={"id_slot": 0},
    )
    assert follow.usage is not None and first.usage is not None
    cached = follow.usage.input_tokens_details.cached_tokens
    # The system prompt, tools and question were computed by the first turn and are reused now.
    assert first.usage.input_tokens - 8 < cached < follow.usage.input_tokens
    assert follow.usage.output_tokens <= 4 and follow.status in ("completed", "incomplete")


def test_a_stream_agrees_with_the_whole_response(oai: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": "tiny-qwen",
        "instructions": SYSTEM,
        "input": "Tell me a story.",
        "max_output_tokens": 10,
        "temperature": 0,
    }
    whole = oai.responses.create(**kwargs)
    events = list(oai.responses.create(**kwargs, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == f"response.{whole.status}"
    last = events[-1].response  # type: ignore[union-attr]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == last.output_text == whole.output_text
    assert last.usage is not None and whole.usage is not None
    assert (last.usage.input_tokens, last.usage.output_tokens) == (
        whole.usage.input_tokens,
        whole.usage.output_tokens,
    )
    assert whole.status == "incomplete" or whole.usage.output_tokens < 10


def test_the_stream_helper_completes_a_forced_call(oai: openai.OpenAI) -> None:
    with oai.responses.stream(
        model="tiny-qwen",
        input=QUESTION,
        tools=[STRICT_WEATHER],
        tool_choice="required",
        max_output_tokens=250,
        temperature=0.7,
    ) as stream:
        fragments = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    [call] = final.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert "".join(fragments) == call.arguments and call.parsed_arguments == json.loads(call.arguments)


async def test_an_openai_agent_calls_its_tool(keyed_engine: EngineProcess) -> None:
    async with openai.AsyncOpenAI(
        base_url=f"{keyed_engine.url}/v1", api_key=API_KEY, max_retries=0
    ) as client:
        agent, cities = weather_agent(client, "tiny-qwen", SYSTEM)
        result = await agents.Runner.run(agent, QUESTION, max_turns=2)
        assert result.final_output == "sunny" and len(cities) == 1
        run = agents.Runner.run_streamed(agent, QUESTION, max_turns=2)
        async for _ in run.stream_events():
            pass
        assert run.final_output == "sunny" and len(cities) == 2


def test_a_bare_engine_stores_nothing(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        oai.responses.create(
            model="tiny-qwen", input="hi", previous_response_id="resp_123", max_output_tokens=2
        )
    assert "keeps no responses" in str(exc.value)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve("resp_123")
    with pytest.raises(openai.NotFoundError):
        oai.responses.delete("resp_123")
    with pytest.raises(openai.NotFoundError):
        oai.responses.input_items.list("resp_123")


def test_bad_responses_requests_name_the_clients_field(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        oai.responses.create(
            model="tiny-qwen",
            input=[
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "https://x/y.png", "detail": "auto"}],
                }
            ],
        )
    assert isinstance(exc.value.body, dict) and exc.value.body["param"] == "input[0].content[0]"
    # Checked by the chat path as max_tokens, refused under the name the client sent.
    with pytest.raises(openai.BadRequestError) as exc:
        oai.responses.create(model="tiny-qwen", input="hi", max_output_tokens=100_000)
    assert isinstance(exc.value.body, dict) and exc.value.body["param"] == "max_output_tokens"
    assert "'max_output_tokens' is 100000" in exc.value.body["message"]


PATCH: Any = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Apply a patch.",
    "format": {
        "type": "grammar",
        "syntax": "regex",
        "definition": r"\*\*\* (Add|Delete) File: [a-z]{1,8}\.py",
    },
}
NAMESPACED: Any = {
    "type": "namespace",
    "name": "weather",
    "description": "Weather tools.",
    "tools": [WEATHER],
}


def test_a_forced_custom_call_s_input_follows_its_grammar_and_continues_from_the_cache(
    oai: openai.OpenAI,
) -> None:
    """A custom tool with a grammar, forced: its call is a custom_tool_call whose input is a sentence
    of the grammar, and the conversation replayed with its output reuses the prompt."""
    for seed in range(3):
        first = oai.responses.create(
            model="tiny-qwen",
            input=QUESTION,
            tools=[PATCH, NAMESPACED],
            tool_choice={"type": "custom", "name": "apply_patch"},
            max_output_tokens=120,
            temperature=1.0,
            extra_body={"seed": seed, "id_slot": 1},
        )
        [call] = [i for i in first.output if i.type == "custom_tool_call"]
        assert call.name == "apply_patch" and call.call_id.startswith("call_")
        assert re.fullmatch(PATCH["format"]["definition"], call.input), call.input
    follow = oai.responses.create(
        model="tiny-qwen",
        input=[
            {"role": "user", "content": QUESTION},
            *[i.model_dump(exclude_none=True) for i in first.output],  # type: ignore[misc]
            {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done"},
        ],
        tools=[PATCH, NAMESPACED],
        max_output_tokens=4,
        temperature=0,
        extra_body={"id_slot": 1},
    )
    assert follow.usage is not None and first.usage is not None
    assert follow.usage.input_tokens_details.cached_tokens > first.usage.input_tokens - 8


def test_under_tool_choice_auto_the_grammar_holds_every_call_the_model_opens(
    oai: openai.OpenAI, keyed_engine: EngineProcess
) -> None:
    """tool_choice auto with a grammar-constrained custom tool: from the call tag on (a random
    model is pushed to write it, by a bias on its token) every call follows the format, and the
    custom tool's input its grammar."""
    r = httpx.post(
        f"{keyed_engine.url}/tokenize",
        json={"content": "<tool_call>"},
        headers={"authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    [tag] = r.json()["tokens"]
    inputs = []
    for seed in range(4):
        answer = oai.responses.create(
            model="tiny-qwen",
            input=QUESTION,
            tools=[PATCH, WEATHER],
            max_output_tokens=200,
            temperature=1.0,
            extra_body={"seed": seed, "logit_bias": {str(tag): 6.0}},
        )
        for item in answer.output:
            if item.type == "custom_tool_call":
                inputs.append(item.input)
                assert re.fullmatch(PATCH["format"]["definition"], item.input), item.input
            elif item.type == "function_call":
                assert item.name == "get_weather" and isinstance(json.loads(item.arguments)["city"], str)
    assert inputs  # the grammar-constrained tool was called at least once


def test_a_namespaced_call_carries_its_namespace(oai: openai.OpenAI) -> None:
    first = oai.responses.create(
        model="tiny-qwen",
        input=QUESTION,
        tools=[NAMESPACED],
        tool_choice={"type": "function", "name": "weather.get_weather"},
        max_output_tokens=250,
        temperature=0,
    )
    [call] = [i for i in first.output if i.type == "function_call"]
    assert (call.namespace, call.name) == ("weather", "get_weather")


def test_hosted_tools_are_left_out_and_said_so(keyed_engine: EngineProcess) -> None:
    body = {
        "model": "tiny-qwen",
        "input": "hi",
        "tools": [WEATHER, {"type": "web_search", "external_web_access": False}],
        "max_output_tokens": 2,
    }
    headers = {"authorization": f"Bearer {API_KEY}"}
    for stream in (False, True):
        r = httpx.post(
            f"{keyed_engine.url}/v1/responses", json={**body, "stream": stream}, headers=headers, timeout=60
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-slotkeeper-omitted-tools"] == "web_search"
    answer = httpx.post(f"{keyed_engine.url}/v1/responses", json=body, headers=headers, timeout=60).json()
    assert answer["slotkeeper"]["omitted_tools"] == [{"type": "web_search", "param": "tools[1]"}]
    assert [t["type"] for t in answer["tools"]] == ["function"]
    sealed = {"type": "reasoning", "summary": [], "encrypted_content": "skr1_abc"}
    r = httpx.post(
        f"{keyed_engine.url}/v1/responses",
        json={**body, "input": [sealed, {"role": "user", "content": "hi"}]},
        headers=headers,
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].encrypted_content"


def test_wrong_keys_are_refused(keyed_engine: EngineProcess) -> None:
    with openai.OpenAI(base_url=f"{keyed_engine.url}/v1", api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            c.responses.create(model="tiny-qwen", input="hi", max_output_tokens=2)
    with anthropic.Anthropic(base_url=keyed_engine.url, api_key="wrong", max_retries=0) as a:
        with pytest.raises(anthropic.AuthenticationError) as exc:
            a.messages.create(model="tiny-qwen", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert exc.value.body == {
            "type": "error",
            "error": {"type": "authentication_error", "message": "Invalid API Key"},
        }
    # The header alone, as Anthropic's SDK sends it, is enough.
    r = httpx.post(
        f"{keyed_engine.url}/v1/messages",
        headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"},
        json={"model": "tiny-qwen", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["type"] == "message"


# -- Messages -----------------------------------------------------------------------------------
def test_forced_tool_use_then_its_result_is_read_from_the_cache(claude: anthropic.Anthropic) -> None:
    question: Any = [{"role": "user", "content": QUESTION}]
    both: Any = {
        "model": "tiny-qwen",
        "system": SYSTEM,
        "tools": [ANTHROPIC_WEATHER],
        "extra_body": {"temperature": 0, "id_slot": 1},
    }
    first = claude.messages.create(
        **both, max_tokens=250, messages=question, tool_choice={"type": "tool", "name": "get_weather"}
    )
    assert first.stop_reason == "tool_use" and first.usage.cache_read_input_tokens == 0
    [use] = first.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    assert isinstance(use.input["city"], str)
    conversation: Any = [
        *question,
        {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
    ]
    follow = claude.messages.create(**both, max_tokens=4, messages=conversation)
    u = follow.usage
    assert u.cache_read_input_tokens is not None and u.cache_creation_input_tokens == 0
    assert first.usage.input_tokens - 8 < u.cache_read_input_tokens and u.input_tokens > 0
    # count_tokens renders the same conversation: everything the follow-up's prompt held.
    count = claude.messages.count_tokens(
        model="tiny-qwen", system=SYSTEM, messages=conversation, tools=[ANTHROPIC_WEATHER]
    )
    assert count.input_tokens == u.input_tokens + u.cache_read_input_tokens


def test_a_message_stream_agrees_with_the_whole_message(claude: anthropic.Anthropic) -> None:
    kwargs: Any = {
        "model": "tiny-qwen",
        "system": SYSTEM,
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "extra_body": {"temperature": 0},
    }
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == text_of(final) == text_of(whole)
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    assert whole.stop_reason in ("max_tokens", "end_turn")
    total = whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == total


def test_stop_sequences_end_the_message(claude: anthropic.Anthropic) -> None:
    kwargs: Any = {
        "model": "tiny-qwen",
        "max_tokens": 24,
        "messages": [{"role": "user", "content": "Count to ten."}],
        "extra_body": {"temperature": 0},
    }
    text = text_of(claude.messages.create(**kwargs))
    # A stop string that first occurs well inside the text the unconstrained request wrote.
    at = next(
        i for i in range(3, len(text) - 2) if text[i : i + 2].strip() and text.find(text[i : i + 2]) == i
    )
    stop = text[at : at + 2]
    stopped = claude.messages.create(**kwargs, stop_sequences=[stop])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert text_of(stopped) == text[:at]
    with claude.messages.stream(**kwargs, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, text_of(final)) == ("stop_sequence", stop, text[:at])


def test_a_streamed_tool_use_parses(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(
        model="tiny-qwen",
        max_tokens=250,
        messages=[{"role": "user", "content": QUESTION}],
        tools=[ANTHROPIC_WEATHER],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0.7, "seed": 4},
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    [use] = final.content
    assert use.type == "tool_use" and isinstance(use.input["city"], str)


def test_images_are_refused_in_anthropics_shape(claude: anthropic.Anthropic) -> None:
    image: Any = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
    }
    with pytest.raises(anthropic.BadRequestError) as exc:
        claude.messages.create(
            model="tiny-qwen",
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}],
        )
    body = exc.value.body
    assert (
        isinstance(body, dict)
        and body["type"] == "error"
        and body["error"]["type"] == "invalid_request_error"
    )
    assert "'messages[0].content[1]': image input is not supported" in body["error"]["message"]

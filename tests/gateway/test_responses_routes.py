"""The Responses API through `slotkeeper serve`, with the official openai client and the OpenAI
Agents SDK: stored responses are durable pointers into sessions, so a `previous_response_id` chain
resumes without re-prefill after serve is SIGKILLed."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any, Literal

import agents
import httpx
import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool
from pydantic import BaseModel

from .conftest import openai_client

SYSTEM = "You are a coding agent. Read files, run tests, fix bugs, and report briefly. " * 4
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def _wait_durable(url: str, session: str, generation: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if httpx.get(f"{url}/v1/sessions/{session}").json().get("generation", 0) >= generation:
            return
        time.sleep(0.05)
    raise AssertionError(f"turn {generation} of {session} never became durable")


def _chain(url: str, previous: str | None, text: str):
    raw = openai_client(url).responses.with_raw_response.create(
        model="gpt-5-codex",  # any name reaches the one served model (no tenants file)
        instructions=SYSTEM,
        input=text,
        previous_response_id=previous,
        max_output_tokens=8,
        temperature=0,
    )
    return raw.parse(), raw.headers


def test_a_previous_response_id_chain_survives_sigkill_of_serve(serve, tmp_path: Path):
    """Turn 3 after SIGKILL + restart gives the uninterrupted run's text and cached_tokens."""
    inputs = ["Step 1: list the files.", "Step 2: run the tests.", "Step 3: fix the failing one."]

    def run(data: Path, kill_before_last: bool) -> list[tuple[str, int, int]]:
        s = serve(data)
        out, previous = [], None
        for i, text in enumerate(inputs):
            if kill_before_last and i == len(inputs) - 1:
                assert s.stop(signal.SIGKILL) == -signal.SIGKILL
                s = serve(data)
            r, headers = _chain(s.url, previous, text)
            assert r.status in ("completed", "incomplete") and r.previous_response_id == previous
            if previous is not None:
                restored = kill_before_last and i == len(inputs) - 1
                assert headers["x-slotkeeper-cache"] == ("restored" if restored else "live")
            out.append((r.output_text, r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens))
            _wait_durable(s.url, headers["x-session-id"], i + 1)
            previous = r.id
        stored = openai_client(s.url).responses.retrieve(previous)
        assert stored.id == previous and stored.output_text == out[-1][0]
        return out

    steady = run(tmp_path / "steady", kill_before_last=False)
    killed = run(tmp_path / "killed", kill_before_last=True)
    assert killed == steady
    # Each continuation reused everything before its new input (prompt = history + new message).
    assert all(cached > 0 for _, _, cached in killed[1:])
    assert killed[2][2] >= killed[1][1]  # turn 3 reused at least all of turn 2's prompt


def test_function_call_and_its_output_continue_the_session(serve, tmp_path: Path):
    s = serve(tmp_path / "data")
    client = openai_client(s.url)
    first = client.responses.create(
        model="any-model",
        input=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=250,
        temperature=0,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    follow = client.responses.create(
        model="any-model",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}],
        tools=[WEATHER],
        max_output_tokens=8,
        temperature=0,
    )
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    items = client.responses.input_items.list(follow.id, order="asc")
    assert [i.type for i in items.data] == ["function_call_output"]

    streamed_text = ""
    with client.responses.stream(
        model="any-model",
        previous_response_id=follow.id,
        input="Thanks. Summarise.",
        tools=[WEATHER],  # tools do not carry over: without them the prompt would change
        max_output_tokens=8,
        temperature=0,
    ) as stream:
        last = None
        for event in stream:
            if event.type == "response.output_text.delta":
                streamed_text += event.delta
            if event.type in ("response.completed", "response.incomplete"):  # 8 tokens: incomplete
                last = event
    assert last is not None
    final = last.response
    assert final.output_text == streamed_text
    assert final.usage.input_tokens_details.cached_tokens > follow.usage.input_tokens // 2
    # Stored when the stream completed: it continues like any other.
    again = client.responses.create(
        model="any-model",
        previous_response_id=final.id,
        input="ok",
        tools=[WEATHER],
        max_output_tokens=4,
        temperature=0,
    )
    assert again.usage.input_tokens_details.cached_tokens > final.usage.input_tokens // 2


# Tenant a's gpt-* models are the served model; b has no model of its own.
TWO_TENANTS = (
    '[tenants.a]\nkeys = ["key-a"]\nmodels = { "gpt-*" = "qwen35-seed0" }\n[tenants.b]\nkeys = ["key-b"]\n'
)


def test_stored_responses_belong_to_their_tenant_and_bad_input_is_precise(serve, tmp_path: Path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TWO_TENANTS)
    s = serve(tmp_path / "data", tenants=tenants)
    a, b = openai_client(s.url, "key-a"), openai_client(s.url, "key-b")
    r = a.responses.create(model="gpt-4.1", input="hello", max_output_tokens=4, temperature=0)
    assert r.model == "gpt-4.1" or r.model == "qwen35-seed0"
    with pytest.raises(openai.NotFoundError):  # the wildcard alias is tenant a's only
        b.responses.create(model="gpt-4.1", input="hello", max_output_tokens=4)
    for call in (
        lambda: b.responses.retrieve(r.id),
        lambda: b.responses.delete(r.id),
        lambda: b.responses.input_items.list(r.id),
        lambda: b.responses.create(model="qwen35-seed0", input="x", previous_response_id=r.id),
        lambda: a.responses.create(model="gpt-4.1", input="x", previous_response_id="resp_nope"),
        lambda: a.responses.retrieve("../../etc/passwd"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    bad_inputs = [
        {"input": [{"type": "function_call_output"}]},  # no call_id
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        {"input": [{"type": "no_such_item"}]},
        {"input": 42},
        {"input": "x", "tools": [{"type": "browser"}]},  # no tool type of the spec (hosted ones are omitted)
    ]
    for extra in bad_inputs:
        with pytest.raises(openai.BadRequestError) as err:
            a.responses.create(model="gpt-4.1", **extra)  # type: ignore[call-overload]
        assert err.value.body and err.value.body.get("message")  # OpenAI error shape
    # The input_items listing's query is bounded like any other tenant input.
    for query, param in (
        ("limit=1000", "limit"),
        ("limit=x", "limit"),
        ("order=up", "order"),
        ("after=x", "after"),
    ):
        got = httpx.get(
            f"{s.url}/v1/responses/{r.id}/input_items?{query}", headers={"Authorization": "Bearer key-a"}
        )
        assert got.status_code == 400 and got.json()["error"]["param"] == param, got.text
    # Checked by the engine's chat path as max_tokens; refused under the name the client sent.
    with pytest.raises(openai.BadRequestError) as err:
        a.responses.create(model="gpt-4.1", input="x", max_output_tokens=1_000_000)
    assert isinstance(err.value.body, dict) and err.value.body["param"] == "max_output_tokens"
    # Deleted: gone for retrieve and for continuation.
    assert a.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError):
        a.responses.create(model="gpt-4.1", input="x", previous_response_id=r.id)
    # store=false: answered, never stored.
    unstored = a.responses.create(model="gpt-4.1", input="x", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(unstored.id)


def weather_agent(client: openai.AsyncOpenAI, seen: list[str], **behaviour: Any) -> Agent:
    """An Agents SDK agent on the gateway's gpt-4.1, its first turn forced to call `get_weather`,
    which records each city it is asked about in `seen`; `behaviour`: how a run ends."""

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"Sunny in {city}"

    return Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model="gpt-4.1", openai_client=client),
        model_settings=ModelSettings(tool_choice="get_weather", max_tokens=250, temperature=0),
        **behaviour,
    )


def test_the_openai_agents_sdk_runs_a_function_tool_to_completion(serve, tmp_path: Path):
    """The Agents SDK with its default Responses model: the tool runs and the run completes (streamed
    and not); a second run continues the first by `previous_response_id` and reuses its state.

    `stop_on_first_tool`: the tool's answer is the final output. Random weights never end a free
    answer by themselves, and the SDK treats a response cut by max_tokens as a failure."""
    agents.set_tracing_disabled(True)  # traces would go to api.openai.com
    s = serve(tmp_path / "data")
    seen: list[str] = []

    async def run() -> None:
        async with openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0) as client:
            agent = weather_agent(client, seen, tool_use_behavior="stop_on_first_tool")
            first = await Runner.run(agent, "Weather in Oslo?", max_turns=2)
            assert first.final_output == f"Sunny in {seen[-1]}" and len(seen) == 1
            streamed = Runner.run_streamed(agent, "Weather in Oslo?", max_turns=2)
            async for _ in streamed.stream_events():
                pass
            assert streamed.final_output == f"Sunny in {seen[-1]}" and len(seen) == 2
            later = await Runner.run(
                agent, "And in Bergen?", max_turns=2, previous_response_id=first.last_response_id
            )
            assert later.final_output == f"Sunny in {seen[-1]}" and len(seen) == 3
            first_usage = first.raw_responses[-1].usage
            later_usage = later.raw_responses[-1].usage
            assert first_usage is not None and later_usage is not None
            # The continuation ran on the first run's session: everything it had was reused.
            assert later_usage.input_tokens_details.cached_tokens >= first_usage.input_tokens

    asyncio.run(run())
    assert all(isinstance(city, str) for city in seen)


def test_the_openai_agents_sdk_runs_a_tool_then_a_second_model_turn(serve, tmp_path: Path):
    """The SDK's default tool use: the tool runs, its result goes back to the model, and the model's
    second turn is the final output. A structured output type (`text.format` json_schema) is what
    ends the random model's second turn: the grammar closes the JSON and then only EOS is left; the
    first turn's forced call wins over it, and the SDK sets tool_choice back to auto after the call."""
    agents.set_tracing_disabled(True)
    s = serve(tmp_path / "data")
    seen: list[str] = []

    class Report(BaseModel):
        sky: Literal["sunny", "rainy"]

    async def run() -> None:
        async with openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0) as client:
            agent = weather_agent(client, seen, output_type=Report)
            result = await Runner.run(agent, "Weather in Oslo?", max_turns=3)
            assert isinstance(result.final_output, Report) and len(seen) == 1
            assert len(result.raw_responses) == 2  # the call, then the answer after its result
            second = result.raw_responses[-1].usage
            assert second is not None and second.input_tokens_details.cached_tokens > 0

    asyncio.run(run())

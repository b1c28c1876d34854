"""An OpenAI Agents SDK agent with one tool, for the tests that run the SDK against an engine or a
gateway (tests/engine_pool/server/apis/test_routes.py, tests/gateway/test_cluster.py)."""

from __future__ import annotations

import agents
import openai


def weather_agent(
    client: openai.AsyncOpenAI, model: str, instructions: str
) -> tuple[agents.Agent, list[str]]:
    """An agent made to call its tool `get_weather` and to stop at the tool's answer ("sunny"), and
    the list of cities the tool was called for."""
    agents.set_tracing_disabled(True)  # traces would go to api.openai.com
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return "sunny"

    agent = agents.Agent(
        name="weather",
        instructions=instructions,
        tools=[get_weather],
        tool_use_behavior="stop_on_first_tool",
        model=agents.OpenAIResponsesModel(model=model, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="get_weather", max_tokens=250, temperature=0),
    )
    return agent, cities

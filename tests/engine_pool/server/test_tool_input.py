"""engine_pool/server/tool_input.py: a custom tool's input grammar as GBNF inside each chat format's
calls, checked the strong way: the core (in-process, tiny random model, several seeds) must accept
the grammar, and every call it writes, read back by the format's own reader, has an input the
grammar admits (the tree matcher of tests/engine_pool/protocol/tool_grammar)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import replace
from typing import Any

import pytest

import native
from engine_pool.errors import BadRequest
from engine_pool.http.body import Body
from engine_pool.protocol.openai_responses.tools import INPUT_PARAMETERS
from engine_pool.protocol.tool_grammar import parse_grammar
from engine_pool.server.chat_request import ChatRequest, constraint, input_schema, lenient_schema, parse_chat
from engine_pool.server.formats import FORMATS, ToolCall
from engine_pool.server.gbnf import check_grammar
from engine_pool.server.grammar import GrammarLimits
from engine_pool.server.limits import RequestLimits
from engine_pool.server.sampling import Sampling
from engine_pool.server.tool_input import gbnf_literal

from ..protocol.tool_grammar.conftest import admits

GRAMMARS = [
    ("regex", r"\d{3}-[a-z]{2,5}"),
    ("regex", r"(foo|bar)+!"),
    ("regex", r"[^a-z\n]{1,12}"),  # control characters, quotes, backslashes and non-ASCII: escaped in JSON
    ("regex", r'"\\q\n\t(x|y)?'),
    ("regex", r"\w{1,6}\s?\W{0,3}"),
    ("lark", 'start: sum\nsum: INT (("+" | "-") INT)~0..3\n%import common.INT'),
    ("lark", 'start: "[" [item ("," item)*] "]"\nitem: "x" | start'),
]


@pytest.fixture(scope="module")
def engine(tiny_model: Callable[..., str]) -> Iterator[native.Engine]:
    config = native.EngineConfig(tiny_model("qwen35"), n_slots=1, n_ctx=2048, n_threads=1)
    with closing(native.Engine(config)) as eng:
        yield eng


def _text(engine: native.Engine, out: native.Completion) -> str | None:
    """The generated text, decoded whole (a character may span tokens); None when the bytes are
    not UTF-8. llama.cpp's grammars read UTF-8 leniently (a lead byte takes the next bytes as its
    continuation unchecked), so a random model that writes byte tokens can spell a character of a
    class with malformed bytes: no grammar can refuse those, and no text holds them."""
    try:
        return b"".join(engine.raw.token_piece(t, True) for t in out.tokens).decode()
    except UnicodeDecodeError:
        return None


def _calls(fmt_name: str, text: str) -> list[ToolCall]:
    tools = [{"type": "function", "function": {"name": n, "parameters": INPUT_PARAMETERS}} for n in ("tool",)]
    stream = FORMATS[fmt_name].stream(tools)
    return [c for c in stream.feed(text) + stream.finish() if isinstance(c, ToolCall)]


def _run(engine: native.Engine, grammar: str, seed: int, **params: Any) -> native.Completion:
    p = native.RequestParams(engine.tokenize("Hello world the model"))
    p.n_predict, p.temperature, p.seed, p.grammar = 400, 1.0, seed, grammar
    for key, value in params.items():
        setattr(p, key, value)
    return engine.generate(0, p)


@pytest.mark.parametrize("fmt_name", list(FORMATS))
@pytest.mark.parametrize(("syntax", "definition"), GRAMMARS, ids=[d[:24] for _, d in GRAMMARS])
def test_a_forced_call_s_input_is_a_sentence_of_the_grammar(
    engine: native.Engine, fmt_name: str, syntax: str, definition: str
) -> None:
    g = parse_grammar(syntax, definition, "definition")
    gbnf = FORMATS[fmt_name].grammar([("tool", input_schema(g))])
    check_grammar(gbnf, 2 << 20, 64)  # within what the engine accepts of a client's own grammar
    finished = 0
    for seed in range(6):
        out = _run(engine, gbnf, seed)
        text = _text(engine, out)
        if out.stop_reason != "eos" or text is None:  # an unbounded repetition went on; bad bytes
            continue
        finished += 1
        [call] = _calls(fmt_name, text)
        assert call.name == "tool"
        value = json.loads(call.arguments)["input"]
        assert admits(g, value), (fmt_name, definition, value)
        if syntax == "regex":
            assert re.fullmatch(definition, value)
    assert finished >= 2


@pytest.mark.parametrize("fmt_name", ["qwen-xml", "hermes"])
def test_under_tool_choice_auto_calls_are_held_from_the_call_tag_on(
    engine: native.Engine, fmt_name: str
) -> None:
    """A lazy grammar (triggered by the tag's token or its spelling) holds every call the model
    opens — a function's by its schema (or the lenient form of one a grammar cannot express),
    the custom tool's input by its grammar — and lets several follow one another."""
    g = parse_grammar("regex", r"(ab|cd){2,4}", "definition")
    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
    odd = {"type": "object", "properties": {"q": {"type": "string", "pattern": "^x"}}, "required": ["q"]}
    tools = [("get_weather", city), ("tool", input_schema(g)), ("search", odd)]
    gbnf = FORMATS[fmt_name].grammar(tools, repeated=True, lenient=lenient_schema)
    (tag,) = engine.tokenize("<tool_call>", False, True)
    seen: set[str] = set()
    for seed in range(6):
        out = _run(
            engine,
            gbnf,
            seed,
            n_predict=160,
            grammar_lazy=True,
            grammar_trigger_patterns=[re.escape("<tool_call>")],
            grammar_trigger_tokens=[tag],
            logit_bias={tag: 8.0},  # a random model opens a call at once
        )
        text = _text(engine, out)
        assert text is not None and text.startswith("<tool_call>"), text
        # The run ends at its token limit (the bias keeps opening calls): its complete calls count.
        complete = text[: text.rfind("</tool_call>") + len("</tool_call>")]
        schemas = {"get_weather": city, "tool": INPUT_PARAMETERS, "search": odd}
        tools_json = [{"function": {"name": n, "parameters": p}} for n, p in schemas.items()]
        stream = FORMATS[fmt_name].stream(tools_json)
        calls = [c for c in stream.feed(complete) + stream.finish() if isinstance(c, ToolCall)]
        for call in calls:
            args = json.loads(call.arguments)
            seen.add(call.name)
            if call.name == "tool":
                assert re.fullmatch(r"(ab|cd){2,4}", args["input"]), text
            elif call.name == "get_weather":
                assert args["city"] in ("Paris", "Rome")
            else:
                assert set(args) == {"q"}
    assert "tool" in seen


def test_characters_reach_the_grammar_text_escaped() -> None:
    assert gbnf_literal('a"\\\x00\x7f\n') == '"a\\"\\\\\\x00\\x7F\\x0A"'


def test_a_grammar_past_the_engine_s_budget_is_a_400() -> None:
    g = parse_grammar("regex", "[a-z]{1,1000}x|abc|def|ghi", "definition")
    with pytest.raises(BadRequest) as exc:
        FORMATS["hermes"].grammar([("tool", input_schema(g))], GrammarLimits(max_bytes=100))
    assert exc.value.status == 400 and "bytes, the limit of this engine" in exc.value.message


def _chat(**fields: Any) -> ChatRequest:
    tool = {"type": "function", "function": {"name": "patch", "parameters": INPUT_PARAMETERS}}
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool], **fields}
    return parse_chat(Body(body), Sampling(), RequestLimits(), n_vocab=1000, n_ctx=1000)


def test_an_input_grammar_is_the_chat_path_s_extension_and_never_reaches_the_template() -> None:
    grammar = {"syntax": "regex", "definition": "p+"}
    req = _chat(
        tools=[
            {
                "type": "function",
                "function": {"name": "patch", "parameters": INPUT_PARAMETERS},
                "input_grammar": grammar,
            }
        ]
    )
    assert list(req.input_grammars) == ["patch"] and "input_grammar" not in req.tools[0]
    con = constraint(req, fmt=FORMATS["qwen-xml"])
    assert con.lazy and con.parse_tools and "patch" in con.grammar
    forced = constraint(replace(req, tool_choice="function", tool_name="patch"), fmt=FORMATS["qwen-xml"])
    assert not forced.lazy and forced.grammar.startswith("root ::=")
    assert not constraint(replace(req, tool_choice="none"), fmt=FORMATS["qwen-xml"]).grammar


@pytest.mark.parametrize(
    ("spec", "extra", "param", "message"),
    [
        ("p+", {}, "tools[0].input_grammar", "must be an object"),
        ({"syntax": "ebnf", "definition": "x"}, {}, "tools[0].input_grammar.syntax", "one of lark, regex"),
        ({"syntax": "regex", "definition": 5}, {}, "tools[0].input_grammar.definition", "must be a string"),
        ({"syntax": "regex", "definition": "(?=a)"}, {}, "tools[0].input_grammar.definition", "lookahead"),
        (
            {"syntax": "regex", "definition": "p+"},
            {"response_format": {"type": "json_object"}},
            "tools[0]",
            "cannot be combined with a constrained reply",
        ),
    ],
)
def test_a_bad_input_grammar_is_a_400_naming_it(
    spec: Any, extra: dict[str, Any], param: str, message: str
) -> None:
    tool = {
        "type": "function",
        "function": {"name": "patch", "parameters": INPUT_PARAMETERS},
        "input_grammar": spec,
    }
    with pytest.raises(BadRequest) as exc:
        constraint(_chat(tools=[tool], **extra))
    assert exc.value.param == param and message in exc.value.message

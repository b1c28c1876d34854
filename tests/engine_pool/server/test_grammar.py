"""engine_pool/server/grammar.py: JSON schema -> GBNF that llama.cpp accepts and whose output validates.

Grammars are checked the strong way: the core (in-process, tiny random model, several seeds) must
accept them and every output must parse and validate against the schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import closing
from typing import Any

import jsonschema
import pytest

import native
from engine_pool.errors import BadRequest
from engine_pool.server.grammar import (
    GrammarLimits,
    json_object_grammar,
    literal,
    schema_grammar,
    tool_call_grammar,
)

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer"},
            "ok": {"type": "boolean"},
            "score": {"type": "number"},
        },
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "a": {"type": "null"},
            "b": {"type": ["string", "null"], "maxLength": 4},
            "c": {"enum": ["x", 1, None]},
        },
    },
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"const": "t"}, "maxItems": 2},
            "kind": {"anyOf": [{"type": "boolean"}, {"type": "string", "maxLength": 3}]},
        },
        "required": ["tags", "kind"],
        "additionalProperties": False,
        "title": "ignored",
    },
    {
        "$defs": {
            "Node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer"},
                    "next": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]},
                },
                "required": ["v", "next"],
            }
        },
        "$ref": "#/$defs/Node",
    },
]


@pytest.fixture(scope="module")
def engine(tiny_model: Callable[..., str]) -> Iterator[native.Engine]:
    config = native.EngineConfig(tiny_model("qwen35"), n_slots=1, n_ctx=1024, n_threads=1)
    with closing(native.Engine(config)) as eng:
        yield eng


def _run(
    engine: native.Engine, grammar: str, seed: int, n: int = 400, bias: dict[int, float] | None = None
) -> native.Completion:
    p = native.RequestParams(engine.tokenize("Hello world the model"))
    p.n_predict, p.temperature, p.seed, p.grammar = n, 1.0, seed, grammar
    p.logit_bias = bias or {}
    return engine.generate(0, p)


def _closing_bias(engine: native.Engine, bias: float = -3.0) -> dict[int, float]:
    """Make `}` unlikely, so that a random model writes several optional properties before closing."""
    return {t: bias for t in range(engine.model.n_vocab) if b"}" in engine.raw.token_piece(t, True)}


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_outputs_validate_against_the_schema(engine: native.Engine, schema: dict[str, Any]) -> None:
    grammar = schema_grammar(schema)
    for seed in range(3):
        out = _run(engine, grammar, seed)
        assert out.stop_reason == "eos", (out.text, grammar)
        jsonschema.validate(json.loads(out.text), schema)


def test_json_object_grammar_gives_an_object(engine: native.Engine) -> None:
    out = _run(engine, json_object_grammar(), 0, n=60)
    assert out.text.startswith("{")


def test_forced_tool_call_uses_the_special_token_spelling(engine: native.Engine) -> None:
    params = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}
    grammar = tool_call_grammar([("get_weather", params), ("noop", {})])
    (special,) = engine.tokenize("<tool_call>", False, True)
    seen_special = False
    for seed in range(4):
        out = _run(engine, grammar, seed)
        assert out.stop_reason == "eos"
        assert out.text.startswith("<tool_call>\n{") and out.text.endswith("}\n</tool_call>")
        call = json.loads(out.text[len("<tool_call>") : -len("</tool_call>")])
        assert call["name"] in ("get_weather", "noop")
        assert call["arguments"] == {} if call["name"] == "noop" else call["arguments"]["unit"] in ("c", "f")
        seen_special |= out.tokens[0] == special
    # `<tool_call>` is one special token here; the grammar's literal admits it (and its spelling).
    assert seen_special


def test_literal_escapes() -> None:
    assert literal('a"b\\c\n') == '"a\\"b\\\\c\\n"'


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "string", "pattern": "^a"}, "unsupported JSON schema keyword(s) pattern at the root"),
        ({"type": "object", "properties": {"x": {"allOf": [{}]}}}, "allOf at /properties/x"),
        ({"$ref": "#/$defs/Missing"}, "points to nothing"),
        ({"$ref": "other.json#/x"}, "only local references"),
        ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "'required' must list names"),
        ({"enum": []}, "'enum' must be a non-empty array"),
        ({"type": "tuple"}, "unknown type 'tuple'"),
        (["not", "a", "schema"], "a schema must be an object"),
    ],
)
def test_unsupported_schemas_are_refused_precisely(schema: Any, message: str) -> None:
    with pytest.raises(BadRequest) as exc:
        schema_grammar(schema)
    assert message in exc.value.message


def _optional(n: int, required: int = 0) -> dict[str, Any]:
    props = {f"p{i}": {"type": "boolean"} for i in range(n)}
    return {
        "type": "object",
        "properties": props,
        "required": [f"p{i}" for i in range(required)],
        "additionalProperties": False,
    }


UNLIMITED = GrammarLimits(max_depth=32, max_bytes=1 << 40, max_rules=1 << 40)


def test_optional_properties_grow_the_grammar_linearly() -> None:
    n = 5000
    small, large = (
        schema_grammar(_optional(n), limits=UNLIMITED),
        schema_grammar(_optional(2 * n), limits=UNLIMITED),
    )
    assert len(large) / len(small) < 2.2, (len(small), len(large))
    # Each property appears a constant number of times: its literal once, its rule in <= 4 places.
    assert small.count('"\\"p1234\\""') == 1
    assert len(re.findall(r"\broot-p1234-kv\b", small)) <= 4
    # The default budget holds OpenAI's own ceiling of 5000 properties.
    assert schema_grammar(_optional(n)) == small


def test_5000_optional_properties_still_validate(engine: native.Engine) -> None:
    # One run: with 5000 properties open after `{`, llama.cpp keeps 5000 stacks (~0.1 s a token).
    schema = _optional(5000)
    out = _run(engine, schema_grammar(schema), seed=4, bias=_closing_bias(engine, -2.0))
    assert out.stop_reason == "eos", out.text
    value = json.loads(out.text)
    jsonschema.validate(value, schema)
    assert value, out.text  # properties were written through the tree, not just `{}`


@pytest.mark.parametrize(("n", "required"), [(2, 0), (7, 0), (50, 0), (9, 3)])
def test_every_ordered_subset_of_optional_properties_validates(
    engine: native.Engine, n: int, required: int
) -> None:
    schema = _optional(n, required)
    grammar = schema_grammar(schema)
    sizes = set()
    for seed in range(4):
        out = _run(engine, grammar, seed, bias=_closing_bias(engine))
        assert out.stop_reason == "eos", (out.text, grammar)
        value = json.loads(out.text)
        jsonschema.validate(value, schema)
        keys = [int(k[1:]) for k in value]
        assert keys == sorted(keys)  # declared order
        sizes.add(len(value))
    assert max(sizes) >= min(2, n)


def test_long_repetitions_still_parse_in_llama_cpp(engine: native.Engine) -> None:
    for schema in (
        {"type": "string", "minLength": 1, "maxLength": 2000},
        {"type": "array", "items": {"type": "integer"}, "maxItems": 2000},
        {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 2000},
        {"type": "array", "items": {"type": "integer"}, "minItems": 2000},
        {"type": "string", "minLength": 2000},
        {"anyOf": [{"type": "string", "maxLength": 2000}, {"type": "null"}]},
        {"type": "array", "items": {"type": "string", "maxLength": 2000}, "maxItems": 2000},
    ):
        out = _run(engine, schema_grammar(schema), seed=0, n=30)
        assert out.stop_reason in ("eos", "length"), schema


def _nested_items(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def test_schema_depth_is_bounded_refs_included() -> None:
    limits = GrammarLimits(max_depth=8)
    schema_grammar(_nested_items(8), limits=limits)
    with pytest.raises(BadRequest) as exc:
        schema_grammar(_nested_items(9), limits=limits)
    assert "the schema nests deeper than 8 levels (at /items/items/items/items/items/items/items/items)" in (
        exc.value.message
    )
    assert exc.value.extra == {"limit": 8}
    # A chain of definitions nests like inline schemas (and would otherwise recurse without bound).
    chain = {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(5000)}, "$ref": "#/$defs/d0"}
    chain["$defs"]["d5000"] = {"type": "null"}
    with pytest.raises(BadRequest, match="nests deeper than 32 levels"):
        schema_grammar(chain)


def test_grammar_size_and_rules_are_bounded_while_building() -> None:
    with pytest.raises(BadRequest) as exc:
        schema_grammar(_optional(200), limits=GrammarLimits(max_rules=100))
    assert "its grammar needs more than 100 rules, the limit of this engine" in exc.value.message
    with pytest.raises(BadRequest) as exc:
        schema_grammar(_optional(200), limits=GrammarLimits(max_bytes=4096))
    assert "its grammar needs more than 4096 bytes, the limit of this engine" in exc.value.message
    # Each level visits the rest of the schema once per type: 2^40 visits unless the budget stops it.
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(40):
        schema = {"type": ["array", "object"], "items": schema, "properties": {"x": schema}}
    with pytest.raises(BadRequest, match="its grammar needs more than"):
        schema_grammar(schema, limits=GrammarLimits(max_depth=128))
    with pytest.raises(BadRequest, match="more than 64 rules"):
        tool_call_grammar([(f"f{i}", _optional(3)) for i in range(20)], GrammarLimits(max_rules=64))


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (
            {"type": "string", "maxLength": 2001},
            "'maxLength' is 2001; grammars here repeat an element at most 2000",
        ),
        ({"type": "array", "minItems": 10**9}, "'minItems' is 1000000000"),
        ({"type": "array", "minItems": "x"}, "'minItems' must be a non-negative integer"),
        ({"type": "string", "minLength": -1}, "'minLength' must be a non-negative integer"),
        ({"type": "string", "minLength": True}, "'minLength' must be a non-negative integer"),
        ({"type": "array", "minItems": 3, "maxItems": 2}, "'maxItems' (2) is smaller than 'minItems' (3)"),
        ({"type": []}, "'type' must be a type name or a non-empty array of type names"),
    ],
)
def test_repetitions_are_checked_precisely(schema: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest) as exc:
        schema_grammar(schema)
    assert message in exc.value.message

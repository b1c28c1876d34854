"""engine_pool/grammar.py: JSON schema -> GBNF that llama.cpp accepts and whose output validates.

Grammars are checked the strong way: the core (in-process, tiny random model, several seeds) must
accept them and every output must parse and validate against the schema.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

import native
from engine_pool.errors import BadRequest
from engine_pool.grammar import json_object_grammar, literal, schema_grammar, tool_call_grammar

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
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[native.Engine]:
    from native.model_gen import write_model

    path = Path(tmp_path_factory.mktemp("grammar")) / "qwen35.gguf"
    write_model(path, "qwen35", size="tiny", seed=0)
    eng = native.Engine(native.EngineConfig(str(path), n_slots=1, n_ctx=1024, n_threads=1))
    yield eng
    eng.close()


def _run(engine: native.Engine, grammar: str, seed: int, n: int = 400) -> native.Completion:
    p = native.RequestParams(engine.tokenize("Hello world the model"))
    p.n_predict, p.temperature, p.seed, p.grammar = n, 1.0, seed, grammar
    return engine.generate(0, p)


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

"""formats/qwen_xml.py: `<function=…><parameter=…>` calls read by the tools' schemas, whole and streamed;
the forced-call grammar judged by llama.cpp and by what a model writes under it."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from engine_pool.errors import BadRequest
from engine_pool.server.formats import FORMATS, ToolCall

from .conftest import (
    Accepts,
    Generate,
    assert_chunkings_read_as_whole,
    function_tool,
    named_arguments,
    read_whole,
    weather_schema,
)

XML = FORMATS["qwen-xml"]
PARAMETER_TYPES = {
    "path": "string",
    "count": "integer",
    "ratio": "number",
    "enabled": "boolean",
    "data": "object",
    "items": "array",
}
WRITE = function_tool(
    "write",
    {
        **{name: {"type": kind} for name, kind in PARAMETER_TYPES.items()},
        "maybe": {"type": ["string", "null"]},
        "mode": {"enum": ["a", "b"]},
    },
    required=["path"],
)
TEXT = (
    "I will write it.\n\n<tool_call>\n<function=write>\n"
    "<parameter=path>\n a <b> & 001\nsecond line \n</parameter>\n"
    "<parameter=count>\n2\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
    '<parameter=enabled>\ntrue\n</parameter>\n<parameter=data>\n{"k": [1]}\n</parameter>\n'
    '<parameter=items>\n[1, "é"]\n</parameter>\n<parameter=maybe>\nnull\n</parameter>\n'
    "<parameter=mode>\nb\n</parameter>\n<parameter=extra>\n3\n</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=ping>\n</function>\n</tool_call>"
)
WEATHER = {
    **weather_schema(note={"anyOf": [{"const": "x"}, {"$ref": "#/$defs/Tag"}]}),
    "$defs": {"Tag": {"type": "string", "enum": ["t1", "t2"]}},
}


def parse(text: str, tools: list[Any] | None = None) -> tuple[str | None, list[ToolCall]]:
    msg = read_whole(XML.stream(tools if tools is not None else [WRITE]), text)
    return msg.content, msg.calls


def test_arguments_are_typed_by_the_schema() -> None:
    msg = read_whole(XML.stream([WRITE]), TEXT)
    assert msg.content == "I will write it."
    assert named_arguments(msg) == [
        (
            "write",
            {
                "path": " a <b> & 001\nsecond line ",  # raw: one newline on each side is the format's
                "count": 2,
                "ratio": 0.5,
                "enabled": True,
                "data": {"k": [1]},
                "items": [1, "é"],
                "maybe": None,
                "mode": "b",
                "extra": "3",  # undeclared: its type is unknown, the text is kept
            },
        ),
        ("ping", {}),
    ]


def test_values_that_are_not_json_keep_their_text() -> None:
    block = (
        "<tool_call><function=write><parameter=path>p</parameter><parameter=maybe>Paris</parameter>"
        "<parameter=enabled>True</parameter><parameter=count>many</parameter></function></tool_call>"
    )
    _, calls = parse(block)
    assert json.loads(calls[0].arguments) == {"path": "p", "maybe": "Paris", "enabled": True, "count": "many"}


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>\n<function=write>\n<parameter=path>\nx\n</parameter>\n",  # stopped inside the call
        '<tool_call>\n{"name": "write"}\n</tool_call>',  # another family's call
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        "<tool_call>\n<function=write>\ntext\n</function>\n</tool_call>",
        "<tool_call>\n<function=write>\n<parameter=path>\nx\n</function>\n</tool_call>",
        "<tool_call>\n<function=write>\n</function>\ntrailing\n</tool_call>",
    ],
)
def test_malformed_blocks_stay_content(block: str) -> None:
    assert parse("see " + block) == ("see " + block, [])


def test_random_chunkings_give_the_whole_result() -> None:
    assert_chunkings_read_as_whole(lambda: XML.stream([WRITE]), TEXT, seed=2)


def test_grammar_writes_strings_raw_and_the_rest_as_json(accepts: Accepts) -> None:
    grammar = XML.grammar([("get_weather", WEATHER), ("ping", {})])
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\n{}\n</parameter>\n"
    unit = "<parameter=unit>\ncelsius\n</parameter>\n"
    end = "</function>\n</tool_call>"
    assert accepts(grammar, call.format("Paris") + unit + end)
    assert accepts(grammar, call.format("Paris") + unit + "<parameter=days>\n3\n</parameter>\n" + end)
    assert accepts(grammar, call.format("") + unit + "<parameter=note>\nt2\n</parameter>\n" + end)
    assert accepts(grammar, "<tool_call>\n<function=ping>\n</function>\n</tool_call>")
    assert not accepts(grammar, call.format("Paris") + end)  # the required unit is missing
    assert not accepts(grammar, call.format("Paris") + "<parameter=unit>\nkelvin\n</parameter>\n" + end)
    assert not accepts(grammar, call.format("Paris") + unit + "<parameter=days>\nthree\n</parameter>\n" + end)
    assert not accepts(grammar, call.format("Paris, Texas!") + unit + end)  # past maxLength
    assert not accepts(grammar, call.format("Paris") + unit)  # unfinished


def test_free_text_cannot_contain_the_closing_tag(accepts: Accepts) -> None:
    grammar = XML.grammar([("note", {"type": "object", "properties": {"text": {"type": "string"}}})])

    def call(text: str) -> str:
        return (
            f"<tool_call>\n<function=note>\n<parameter=text>\n{text}\n</parameter>\n</function>\n</tool_call>"
        )

    for text in ("", "a\nb", "x < y </para", "</param</parameter", "<<</p>", "ends with </parameter"):
        assert accepts(grammar, call(text)), text
    for text in ("a </parameter> b", "</parameter>", "<</parameter>"):
        assert not accepts(grammar, call(text)), text


def test_generated_calls_parse_into_the_forced_call(generate: Generate) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    grammar = XML.grammar([("get_weather", WEATHER)])
    for seed in range(4):
        out = generate(grammar, seed)
        assert out.stop_reason == "eos", out.text
        content, calls = parse(out.text, tools)
        assert content is None and [c.name for c in calls] == ["get_weather"], out.text
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"type": "array"}, "must be an object schema"),
        ({"type": "object", "properties": {"a>b": {"type": "string"}}}, "cannot contain '>'"),
        ({"type": "object", "properties": {"a": {"type": "string", "pattern": "x"}}}, "pattern"),
        ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "'required'"),
    ],
)
def test_schemas_the_format_cannot_force_are_refused(params: Any, message: str) -> None:
    with pytest.raises(BadRequest) as exc:
        XML.grammar([("f", params)])
    assert message in exc.value.message

"""Qwen3-Coder XML tool calls (Qwen3.5/3.6, Qwen3-Next, Qwen3-Coder, Nemotron-3).

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Each argument is written on its own: a string parameter raw (no quotes, no escapes, any number of
lines), any other as JSON. Which one is decided by the tool's JSON schema, as llama.cpp's and
vLLM's qwen3-coder parsers do: a parameter whose every admitted value is a string (type string, a
string enum or const, a union of those) is raw text; any other value is read as JSON, and kept as
the raw text when it is not JSON (a model may well write `Paris` for a `["string", "null"]`
parameter). A parameter the tool does not declare has no known type: its text is kept as a
string. One newline after `<parameter=NAME>` and one before `</parameter>` belong to the format,
not to the value.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..grammar import GrammarBuilder, input_grammar, literal
from ..tool_input import input_expr
from .calls import ToolCall, arguments_json, loads_json

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"
_REF = re.compile(r"#/(\$defs|definitions)/([^/]+)")
_MAX_DEPTH = 32  # schema nesting followed when deciding whether a parameter is a string


def parse_block(block: str, schemas: Mapping[str, Any]) -> list[ToolCall] | None:
    """The calls in the text between the tags (one `<function=...>` each, usually), or None when it
    is not a call block. `schemas`: each tool's parameters schema, by name."""
    calls = []
    pos = _skip_space(block, 0)
    while pos < len(block):
        if not block.startswith(FUNCTION, pos):
            return None
        end = block.find(">", pos)
        name = block[pos + len(FUNCTION) : end].strip() if end >= 0 else ""
        if not name or "\n" in name:
            return None
        schema = schemas.get(name)
        props = schema.get("properties") if isinstance(schema, dict) else None
        args: dict[str, Any] = {}
        pos = _skip_space(block, end + 1)
        while not block.startswith(FUNCTION_END, pos):
            if not block.startswith(PARAMETER, pos):
                return None  # something else, or the end of an unfinished call
            end = block.find(">", pos)
            key = block[pos + len(PARAMETER) : end].strip() if end >= 0 else ""
            close = block.find(PARAMETER_END, end + 1)
            if not key or "\n" in key or close < 0:
                return None
            raw = _strip_one_newline(block[end + 1 : close])
            sub = props.get(key) if isinstance(props, dict) else None
            args[key] = raw if sub is None else convert(raw, sub, schema)
            pos = _skip_space(block, close + len(PARAMETER_END))
        calls.append(ToolCall(name, arguments_json(args)))
        pos = _skip_space(block, pos + len(FUNCTION_END))
    return calls or None


def convert(raw: str, schema: Any, root: Any) -> Any:
    """A parameter's value from its text, by its schema (`root`: the tool's parameters, where `$ref`s
    point)."""
    if is_string(schema, root):
        return raw
    try:
        return loads_json(raw)
    except ValueError:
        pass
    word = raw.strip()
    if word in ("True", "False"):  # Python's spelling, which models trained on Python repr write
        return word == "True"
    return raw


def is_string(schema: Any, root: Any, depth: int = 0) -> bool:
    """Whether every value `schema` admits is a string (such a parameter is written raw)."""
    if depth > _MAX_DEPTH or not isinstance(schema, dict):
        return False
    if "$ref" in schema:
        return is_string(_resolve(schema["$ref"], root), root, depth + 1)
    if "const" in schema:
        return isinstance(schema["const"], str)
    if "enum" in schema:
        values = schema["enum"]
        return isinstance(values, list) and bool(values) and all(isinstance(v, str) for v in values)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            subs = schema[key]
            return isinstance(subs, list) and bool(subs) and all(is_string(s, root, depth + 1) for s in subs)
    types = schema.get("type")
    if isinstance(types, list):
        return bool(types) and all(t == "string" for t in types) and schema.get("nullable") is not True
    return types == "string" and schema.get("nullable") is not True


def call_grammar(b: GrammarBuilder, name: str, args: Any) -> str:
    """One call of `name`: every declared parameter in order, the required ones always, string
    values as raw text that cannot contain `</parameter>`, other values as JSON.

    A bounded string (`maxLength`) leaves out `<` so that its length stays exact; an unbounded one
    may contain any text without `</parameter>`.
    """
    if any(c in name for c in ">\n"):
        raise b.fail("", "a function name cannot contain '>' or a newline in this format")
    props, required = b.parameters(args)
    parts = [literal(f"{OPEN}\n{FUNCTION}{name}>\n")]
    for key, sub in props.items():
        if not key or any(c in key for c in ">\n"):
            raise b.fail(
                f"/properties/{key}", "a parameter name cannot contain '>' or a newline in this format"
            )
        path, hint = f"/properties/{key}", f"{name}-{key}"
        value = _string_value(b, sub, path, hint) if is_string(sub, args) else b.visit(sub, path, hint, 2)
        body = (
            f"{literal(f'{PARAMETER}{key}>' + chr(10))} {value} {literal(chr(10) + PARAMETER_END + chr(10))}"
        )
        param = b.add(f"{hint}-param", body)
        parts.append(param if key in required else f"{param}?")
    parts.append(literal(f"{FUNCTION_END}\n{CLOSE}"))
    return " ".join(parts)


def _string_value(b: GrammarBuilder, schema: dict[str, Any], path: str, hint: str, depth: int = 0) -> str:
    if (g := input_grammar(schema)) is not None:  # a custom tool's input, raw
        return input_expr(b, g, hint, json_string=False)
    b.check_keywords(schema, path)
    if "$ref" in schema:
        return _string_value(b, _resolve(schema["$ref"], b.root_schema), schema["$ref"], hint, depth + 1)
    if "const" in schema:
        return literal(schema["const"])
    if "enum" in schema:
        return "(" + " | ".join(literal(v) for v in schema["enum"]) + ")"
    for key in ("anyOf", "oneOf"):
        if key in schema:
            alts = [
                _string_value(b, s, f"{path}/{key}/{i}", hint, depth + 1) for i, s in enumerate(schema[key])
            ]
            return "(" + " | ".join(alts) + ")"
    lo, hi = b.bounds(schema, "minLength", "maxLength", path)
    if hi is not None:
        return b.add(f"{hint}-text", f"[^<]{{{lo},{hi}}}")
    free = b.text_without(PARAMETER_END)
    return b.add(f"{hint}-text", f"[^<]{{{lo}}} {free}") if lo else free


def _resolve(ref: Any, root: Any) -> Any:
    m = _REF.fullmatch(ref) if isinstance(ref, str) else None
    defs = root.get(m.group(1)) if m is not None and isinstance(root, dict) else None
    return defs.get(m.group(2)) if isinstance(defs, dict) and m is not None else None


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _strip_one_newline(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _value_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def write_calls(calls: Sequence[tuple[str, Any]]) -> str:
    """Calls ((name, arguments) pairs) as a model of the family writes them: a string value as it
    is, any other value as JSON."""
    blocks = []
    for name, args in calls:
        items = args.items() if isinstance(args, dict) else ()
        params = "".join(
            f"{PARAMETER}{key}>\n{_value_text(value)}\n{PARAMETER_END}\n" for key, value in items
        )
        blocks.append(f"{OPEN}\n{FUNCTION}{name}>\n{params}{FUNCTION_END}\n{CLOSE}")
    return "\n".join(blocks)

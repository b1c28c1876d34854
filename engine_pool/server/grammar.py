"""llama.cpp GBNF grammars for constrained output: JSON schema, any JSON object, forced tool calls.

`schema_grammar` covers the common subset of JSON schema: object (properties, required; properties
are emitted in their declared order, optional ones may be left out), string (minLength,
maxLength), number, integer, boolean, null, array (items, minItems, maxItems), enum, const, anyOf /
oneOf, type lists, and local `$ref`s into `$defs`/`definitions` (recursion allowed). Keywords that
only annotate (title, description, format, default, examples, additionalProperties, ...) are
ignored; keywords that constrain values in ways a grammar here does not express (pattern, allOf,
not, if/then, ...) are refused with a precise message rather than silently dropped.

Numbers have bounded digits and whitespace is at most one space, so that even a random model
reaches the end of the grammar in a bounded number of tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from .errors import BadRequest

_PRIMITIVES = {
    "space": '" "?',
    # Printable code points that are valid in UTF-8 (no surrogates, nothing past U+10FFFF), or an escape.
    "char": r"[\x20-\x21\x23-\x5B\x5D-\x7E\u0080-\uD7FF\uE000-\U0010FFFF]"
    r' | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})',
    "string": r'"\"" char* "\"" space',
    "integer": '"-"? ([0-9] | [1-9] [0-9]{0,15}) space',
    "number": '"-"? ([0-9] | [1-9] [0-9]{0,15}) ("." [0-9]{1,15})? ([eE] [-+]? [0-9]{1,3})? space',
    "boolean": '("true" | "false") space',
    "null": '"null" space',
    "value": "object | array | string | number | boolean | null",
    "object": '"{" space ( string ":" space value ("," space string ":" space value)* )? "}" space',
    "array": '"[" space ( value ("," space value)* )? "]" space',
}
# What each primitive rule needs defined alongside it.
_NEEDS = {
    "string": ("char", "space"),
    "integer": ("space",),
    "number": ("space",),
    "boolean": ("space",),
    "null": ("space",),
    "value": ("object", "array", "string", "number", "boolean", "null"),
    "object": ("space", "string", "value"),
    "array": ("space", "value"),
}
_IGNORED = {
    "title",
    "description",
    "format",
    "default",
    "examples",
    "additionalProperties",
    "$schema",
    "$id",
    "$defs",
    "definitions",
    "strict",
    "deprecated",
    "readOnly",
    "writeOnly",
    "$comment",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "uniqueItems",
    "discriminator",
}
_HANDLED = {
    "type",
    "properties",
    "required",
    "items",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "$ref",
    "nullable",
}


def literal(text: str) -> str:
    """A GBNF string literal matching `text` exactly."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return '"' + escaped.replace("\t", "\\t") + '"'


class _Builder:
    def __init__(self, root_schema: Any, where: str) -> None:
        self.rules: dict[str, str] = {}
        self.root_schema = root_schema
        self.where = where
        self.refs: dict[str, str] = {}

    def use(self, name: str) -> str:
        if name not in self.rules:
            self.rules[name] = _PRIMITIVES[name]
            for dep in _NEEDS.get(name, ()):
                self.use(dep)
        return name

    def add(self, hint: str, body: str) -> str:
        base = re.sub(r"[^a-zA-Z0-9-]+", "-", hint).strip("-").lower() or "r"
        name, i = base, 1
        while name in self.rules or name in _PRIMITIVES:
            i += 1
            name = f"{base}-{i}"
        self.rules[name] = body
        return name

    def fail(self, path: str, what: str) -> BadRequest:
        return BadRequest(f"{self.where}: {what} at {path or 'the root'}", param=self.where)

    def visit(self, schema: Any, path: str, hint: str) -> str:
        """A GBNF expression matching `schema` (followed by optional whitespace)."""
        if schema is True or schema == {}:
            return self.use("value")
        if not isinstance(schema, dict):
            raise self.fail(path, f"a schema must be an object, got {type(schema).__name__}")
        unknown = sorted(k for k in schema if k not in _HANDLED and k not in _IGNORED)
        if unknown:
            raise self.fail(path, f"unsupported JSON schema keyword(s) {', '.join(unknown)}")
        if "$ref" in schema:
            return self.ref(schema["$ref"], path)
        if "const" in schema:
            return f"{literal(json.dumps(schema['const'], ensure_ascii=False))} {self.use('space')}"
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise self.fail(path, "'enum' must be a non-empty array")
            choices = " | ".join(literal(json.dumps(v, ensure_ascii=False)) for v in values)
            return f"({choices}) {self.use('space')}"
        for key in ("anyOf", "oneOf"):
            if key in schema:
                subs = schema[key]
                if not isinstance(subs, list) or not subs:
                    raise self.fail(path, f"'{key}' must be a non-empty array")
                alts = [self.visit(s, f"{path}/{key}/{i}", hint) for i, s in enumerate(subs)]
                return "(" + " | ".join(alts) + ")"
        types = schema.get("type")
        if isinstance(types, list):
            rest = {k: v for k, v in schema.items() if k != "type"}
            return "(" + " | ".join(self.visit({**rest, "type": t}, path, hint) for t in types) + ")"
        expr = self.typed(schema, types, path, hint)
        if schema.get("nullable") is True:
            expr = f"({expr} | {self.use('null')})"
        return expr

    def typed(self, schema: dict[str, Any], t: Any, path: str, hint: str) -> str:
        if t is None:
            t = "object" if "properties" in schema else "array" if "items" in schema else None
        if t is None:
            return self.use("value")
        if t in ("integer", "number", "boolean", "null"):
            return self.use(t)
        if t == "string":
            lo, hi = schema.get("minLength", 0), schema.get("maxLength")
            if lo == 0 and hi is None:
                return self.use("string")
            self.use("char")
            rep = f"{{{lo},{hi}}}" if hi is not None else f"{{{lo},}}"
            return f'"\\"" char{rep} "\\"" {self.use("space")}'
        if t == "array":
            return self.array(schema, path, hint)
        if t == "object":
            return self.object(schema, path, hint)
        raise self.fail(path, f"unknown type {t!r}")

    def array(self, schema: dict[str, Any], path: str, hint: str) -> str:
        items = schema.get("items", {})
        item = self.add(f"{hint}-item", self.visit(items, f"{path}/items", f"{hint}-item"))
        lo, hi = int(schema.get("minItems", 0)), schema.get("maxItems")
        sp = self.use("space")
        if hi is not None and int(hi) == 0:
            return f'"[" {sp} "]" {sp}'
        more = f'("," {sp} {item})'
        rep = (
            f"{{{max(lo - 1, 0)},{int(hi) - 1}}}" if hi is not None else (f"{{{lo - 1},}}" if lo > 1 else "*")
        )
        body = f"{item} {more}{rep}"
        if lo == 0:
            body = f"({body})?"
        return f'"[" {sp} {body} "]" {sp}'

    def object(self, schema: dict[str, Any], path: str, hint: str) -> str:
        props = schema.get("properties")
        if props is None:
            return self.use("object")
        if not isinstance(props, dict):
            raise self.fail(path, "'properties' must be an object")
        required = schema.get("required", [])
        if not isinstance(required, list) or any(r not in props for r in required):
            raise self.fail(path, "'required' must list names from 'properties'")
        sp = self.use("space")
        kvs = {}
        for name, sub in props.items():
            value = self.visit(sub, f"{path}/properties/{name}", f"{hint}-{name}")
            kvs[name] = self.add(
                f"{hint}-{name}-kv", f'{literal(json.dumps(name, ensure_ascii=False))} {sp} ":" {sp} {value}'
            )
        req = [kvs[n] for n in props if n in required]
        opt = [kvs[n] for n in props if n not in required]
        if req:
            body = f' "," {sp} '.join(req) + "".join(f' ("," {sp} {o})?' for o in opt)
        elif opt:
            # Any ordered subset of the optional properties: the first one present, then the rest.
            alts = [o + "".join(f' ("," {sp} {x})?' for x in opt[i + 1 :]) for i, o in enumerate(opt)]
            body = "(" + " | ".join(alts) + ")?"
        else:
            body = ""
        return f'"{{" {sp} {body} "}}" {sp}'

    def ref(self, ref: Any, path: str) -> str:
        m = re.fullmatch(r"#/(\$defs|definitions)/([^/]+)", ref) if isinstance(ref, str) else None
        if m is None:
            raise self.fail(path, f"only local references like '#/$defs/Name' are supported, got {ref!r}")
        if ref in self.refs:
            return self.refs[ref]
        defs = self.root_schema.get(m.group(1), {}) if isinstance(self.root_schema, dict) else {}
        if m.group(2) not in defs:
            raise self.fail(path, f"reference {ref!r} points to nothing")
        name = self.add(f"def-{m.group(2)}", "")  # reserved first: the definition may refer to itself
        self.refs[ref] = name
        self.rules[name] = self.visit(defs[m.group(2)], ref[1:], f"def-{m.group(2)}")
        return name

    def text(self, root: str) -> str:
        lines = [f"root ::= {root}"] + [f"{k} ::= {v}" for k, v in self.rules.items()]
        return "\n".join(lines) + "\n"


def schema_grammar(schema: Any, where: str = "response_format.json_schema.schema") -> str:
    """A GBNF grammar whose sentences are JSON documents valid for `schema`."""
    b = _Builder(schema, where)
    return b.text(b.visit(schema, "", "root"))


def json_object_grammar() -> str:
    """Any JSON object (response_format json_object)."""
    b = _Builder({}, "response_format")
    return b.text(b.use("object"))


def tool_call_grammar(tools: Sequence[tuple[str, Any]]) -> str:
    """Exactly one `<tool_call>` block calling one of `tools` ((name, parameters schema) pairs).

    The opening and closing tags are string literals: llama.cpp matches grammar literals against
    token texts, so they accept the single special token `<tool_call>` as well as its spelling.
    """
    b = _Builder({}, "tools")
    alts = []
    for name, params in tools:
        b.root_schema, b.refs = (params if isinstance(params, dict) else {}), {}
        b.where = f"tools[{name}].function.parameters"
        # A function declared without parameters takes none: its arguments are exactly `{}`.
        args = b.visit(params if params else {"type": "object", "properties": {}}, "", f"args-{name}")
        head = literal('<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ')
        alts.append(
            b.add(f"call-{name}", f"{head} {args} {literal('}')} {literal(chr(10) + '</tool_call>')}")
        )
    return b.text(" | ".join(alts))

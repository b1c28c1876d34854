"""llama.cpp GBNF grammars for constrained output: JSON schema, any JSON object, forced tool calls.

`schema_grammar` covers the common subset of JSON schema: object (properties, required; properties
are emitted in their declared order, optional ones may be left out), string (minLength,
maxLength), number, integer, boolean, null, array (items, minItems, maxItems), enum, const, anyOf /
oneOf, type lists, and local `$ref`s into `$defs`/`definitions` (recursion allowed). Keywords that
only annotate (title, description, format, default, examples, additionalProperties, ...) are
ignored, and so are numeric bounds and uniqueItems (minimum, maximum, exclusive*, multipleOf: the
output is a number of the right type, not necessarily within them); other keywords that constrain
values in ways a grammar here does not express (pattern, allOf, not, if/then, ...) are refused with
a precise message rather than silently dropped.

Numbers have bounded digits and whitespace is at most one space, so that even a random model
reaches the end of the grammar in a bounded number of tokens.

The output is linear in the schema: every property, `$ref` and item appears a constant number of
times, and optional properties become a balanced tree of named rules (depth log N: llama.cpp's
left-recursion check and stack expansion recurse along rule references). `GrammarLimits` bounds the
schema's depth (`$ref`s included) and the grammar's bytes and rules while it is built, so a hostile
schema is refused (400) after bounded work. Building can still take a while for a large schema:
callers run it in a worker thread.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog

from ..errors import BadRequest

log = structlog.get_logger("engine.grammar")
T = TypeVar("T")

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
# Keywords that only annotate: ignored. Every other keyword not handled is refused.
_IGNORED = frozenset(
    "title description format default examples additionalProperties $schema $id $defs definitions strict"
    " deprecated readOnly writeOnly $comment minimum maximum exclusiveMinimum exclusiveMaximum multipleOf"
    " uniqueItems discriminator".split()
)
_HANDLED = frozenset(
    "type properties required items minItems maxItems minLength maxLength enum const anyOf oneOf $ref"
    " nullable".split()
)

# llama.cpp refuses a repetition `x{m}`, `x{m,}` past 2000 (MAX_REPETITION_THRESHOLD; a group
# `( ... ){0,n}` fails already past 1000, so repeated items are named rules): minLength, maxLength,
# minItems and maxItems above this are refused here, precisely, rather than by llama.cpp's parser.
MAX_REPETITION = 2000


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on a grammar built from JSON schemas (settings --max-schema-*)."""

    max_depth: int = 32
    max_bytes: int = 2 << 20
    max_rules: int = 32768


def literal(text: str) -> str:
    """A GBNF string literal matching `text` exactly."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return '"' + escaped.replace("\t", "\\t") + '"'


class _Builder:
    def __init__(self, root_schema: Any, where: str, limits: GrammarLimits) -> None:
        self.rules: dict[str, str] = {}
        self.root_schema = root_schema
        self.where = where
        self.refs: dict[str, str] = {}
        self.limits = limits
        self.size = 0  # bytes of the rules so far (names and bodies)
        self.visits = 0
        self._next: dict[str, int] = {}  # rule name base -> next suffix (no quadratic name search)

    def use(self, name: str) -> str:
        if name not in self.rules:
            self._put(name, _PRIMITIVES[name])
            for dep in _NEEDS.get(name, ()):
                self.use(dep)
        return name

    def add(self, hint: str, body: str) -> str:
        # Names only need to be unique and readable: a long property name stays in its literal.
        base = re.sub(r"[^a-zA-Z0-9-]+", "-", hint[-200:]).strip("-").lower()[-80:].strip("-") or "r"
        k = self._next.get(base, 1)
        name = base if k == 1 else f"{base}-{k}"
        while name in self.rules or name in _PRIMITIVES:
            k += 1
            name = f"{base}-{k}"
        self._next[base] = k + 1
        self._put(name, body)
        return name

    def _put(self, name: str, body: str) -> None:
        self.size += len(name) + len(body) + 5
        self.rules[name] = body
        self.check_budget()

    def check_budget(self) -> None:
        lim = self.limits
        if len(self.rules) > lim.max_rules or self.visits > lim.max_rules:
            raise BadRequest(
                f"{self.where}: the schema is too large to constrain the output: its grammar needs more "
                f"than {lim.max_rules} rules, the limit of this engine",
                param=self.where,
                extra={"limit": lim.max_rules},
            )
        if self.size > lim.max_bytes:
            raise BadRequest(
                f"{self.where}: the schema is too large to constrain the output: its grammar needs more "
                f"than {lim.max_bytes} bytes, the limit of this engine",
                param=self.where,
                extra={"limit": lim.max_bytes},
            )

    def fail(self, path: str, what: str) -> BadRequest:
        return BadRequest(f"{self.where}: {what} at {path or 'the root'}", param=self.where)

    def visit(self, schema: Any, path: str, hint: str, depth: int = 1) -> str:
        """A GBNF expression matching `schema` (followed by optional whitespace); `depth` counts
        nested schemas, `$ref`s included (a chain of definitions nests like inline schemas)."""
        self.visits += 1
        self.check_budget()
        if depth > self.limits.max_depth:
            raise BadRequest(
                f"{self.where}: the schema nests deeper than {self.limits.max_depth} levels "
                f"(at {path or 'the root'}); this engine accepts at most {self.limits.max_depth}",
                param=self.where,
                extra={"limit": self.limits.max_depth},
            )
        if schema is True or schema == {}:
            return self.use("value")
        if not isinstance(schema, dict):
            raise self.fail(path, f"a schema must be an object, got {type(schema).__name__}")
        unknown = sorted(k for k in schema if k not in _HANDLED and k not in _IGNORED)
        if unknown:
            raise self.fail(path, f"unsupported JSON schema keyword(s) {', '.join(unknown)}")
        if "$ref" in schema:
            return self.ref(schema["$ref"], path, depth)
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
                alts = [self.visit(s, f"{path}/{key}/{i}", hint, depth + 1) for i, s in enumerate(subs)]
                return "(" + " | ".join(alts) + ")"
        types = schema.get("type")
        if isinstance(types, list):
            if not types or not all(isinstance(t, str) for t in types):
                raise self.fail(path, "'type' must be a type name or a non-empty array of type names")
            rest = {k: v for k, v in schema.items() if k != "type"}
            # Each type visits the rest of the schema again: never twice for the same type.
            unique = list(dict.fromkeys(types))
            return "(" + " | ".join(self.visit({**rest, "type": t}, path, hint, depth) for t in unique) + ")"
        expr = self.typed(schema, types, path, hint, depth)
        if schema.get("nullable") is True:
            expr = f"({expr} | {self.use('null')})"
        return expr

    def typed(self, schema: dict[str, Any], t: Any, path: str, hint: str, depth: int) -> str:
        if t is None:
            t = "object" if "properties" in schema else "array" if "items" in schema else None
        if t is None:
            return self.use("value")
        if t in ("integer", "number", "boolean", "null"):
            return self.use(t)
        if t == "string":
            lo, hi = self.bounds(schema, "minLength", "maxLength", path)
            if lo == 0 and hi is None:
                return self.use("string")
            self.use("char")
            rep = f"{{{lo},{hi}}}" if hi is not None else f"{{{lo},}}"
            # Named: llama.cpp multiplies nested repetitions against its limit (a `?` around this).
            return self.add(f"{hint}-string", f'"\\"" char{rep} "\\"" {self.use("space")}')
        if t == "array":
            return self.array(schema, path, hint, depth)
        if t == "object":
            return self.object(schema, path, hint, depth)
        raise self.fail(path, f"unknown type {t!r}")

    def bounds(self, schema: dict[str, Any], lo_key: str, hi_key: str, path: str) -> tuple[int, int | None]:
        """(min, max) of a repetition: integers, min <= max, within llama.cpp's repetition limit."""
        out: list[int | None] = []
        for key, default in ((lo_key, 0), (hi_key, None)):
            v = schema.get(key, default)
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise self.fail(path, f"'{key}' must be a non-negative integer")
            if v is not None and v > MAX_REPETITION:
                raise self.fail(
                    path, f"'{key}' is {v}; grammars here repeat an element at most {MAX_REPETITION} times"
                )
            out.append(v)
        lo, hi = out
        assert lo is not None
        if hi is not None and hi < lo:
            raise self.fail(path, f"'{hi_key}' ({hi}) is smaller than '{lo_key}' ({lo})")
        return lo, hi

    def array(self, schema: dict[str, Any], path: str, hint: str, depth: int) -> str:
        items = schema.get("items", {})
        item = self.add(f"{hint}-item", self.visit(items, f"{path}/items", f"{hint}-item", depth + 1))
        lo, hi = self.bounds(schema, "minItems", "maxItems", path)
        sp = self.use("space")
        if hi == 0:
            return f'"[" {sp} "]" {sp}'
        more = self.add(f"{hint}-more", f'"," {sp} {item}')
        rep = f"{{{max(lo - 1, 0)},{hi - 1}}}" if hi is not None else (f"{{{lo - 1},}}" if lo > 1 else "*")
        body = f"{item} {more}{rep}"
        if lo == 0:  # named, for the same reason as bounded strings
            body = f"{self.add(f'{hint}-items', body)}?"
        return f'"[" {sp} {body} "]" {sp}'

    def object(self, schema: dict[str, Any], path: str, hint: str, depth: int) -> str:
        props = schema.get("properties")
        if props is None:
            return self.use("object")
        if not isinstance(props, dict):
            raise self.fail(path, "'properties' must be an object")
        required = schema.get("required", [])
        if not isinstance(required, list) or any(not isinstance(r, str) or r not in props for r in required):
            raise self.fail(path, "'required' must list names from 'properties'")
        sp = self.use("space")
        kvs = {}
        for name, sub in props.items():
            value = self.visit(sub, f"{path}/properties/{name}", f"{hint}-{name}", depth + 1)
            kvs[name] = self.add(
                f"{hint}-{name}-kv", f'{literal(json.dumps(name, ensure_ascii=False))} {sp} ":" {sp} {value}'
            )
        needed = set(required)
        req = [kvs[n] for n in props if n in needed]
        opt = _OptionalProperties(self, hint, [kvs[n] for n in props if n not in needed], sp)
        if req:
            body = f' "," {sp} '.join(req) + (f" {opt.rest()}" if opt.kvs else "")
        elif opt.kvs:
            body = f"({opt.first()})?"
        else:
            body = ""
        return f'"{{" {sp} {body} "}}" {sp}'

    def ref(self, ref: Any, path: str, depth: int) -> str:
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
        body = self.visit(defs[m.group(2)], ref[1:], f"def-{m.group(2)}", depth + 1)
        self.size += len(body)
        self.rules[name] = body
        self.check_budget()
        return name

    def text(self, root: str) -> str:
        self.size += len(root) + 10
        self.check_budget()
        lines = [f"root ::= {root}"] + [f"{k} ::= {v}" for k, v in self.rules.items()]
        return "\n".join(lines) + "\n"


class _OptionalProperties:
    """Optional properties `kvs` (in order) as a balanced tree of named rules.

    Any ordered subset of them may appear. `rest()` matches such a subset with a comma before each
    (after required properties); `first()` a non-empty subset without a leading comma (an object of
    optional properties only). Each node of the tree over `kvs[lo:hi]` is one rule built from its
    two halves, memoised, so every property appears a constant number of times — the flat form
    (for each property, "it first, then any of the rest") is quadratic in their number.
    """

    def __init__(self, b: _Builder, hint: str, kvs: list[str], sp: str) -> None:
        self.b, self.hint, self.kvs, self.sp = b, hint, kvs, sp
        self._rest: dict[tuple[int, int], str] = {}
        self._first: dict[tuple[int, int], str] = {}

    def rest(self, lo: int = 0, hi: int | None = None) -> str:
        hi = len(self.kvs) if hi is None else hi
        if hi - lo == 1:
            return f'("," {self.sp} {self.kvs[lo]})?'
        if (lo, hi) not in self._rest:
            mid = (lo + hi) // 2
            self._rest[lo, hi] = self.b.add(f"{self.hint}-rest", f"{self.rest(lo, mid)} {self.rest(mid, hi)}")
        return self._rest[lo, hi]

    def first(self, lo: int = 0, hi: int | None = None) -> str:
        hi = len(self.kvs) if hi is None else hi
        if hi - lo == 1:
            return self.kvs[lo]
        if (lo, hi) not in self._first:
            mid = (lo + hi) // 2
            # The first property present is in the left half (then any of the right), or not.
            body = f"{self.first(lo, mid)} {self.rest(mid, hi)} | {self.first(mid, hi)}"
            self._first[lo, hi] = self.b.add(f"{self.hint}-first", body)
        return self._first[lo, hi]


def schema_grammar(
    schema: Any, where: str = "response_format.json_schema.schema", limits: GrammarLimits | None = None
) -> str:
    """A GBNF grammar whose sentences are JSON documents valid for `schema`, within `limits`."""
    b = _Builder(schema, where, limits or GrammarLimits())
    return b.text(b.visit(schema, "", "root"))


def json_object_grammar() -> str:
    """Any JSON object (response_format json_object)."""
    b = _Builder({}, "response_format", GrammarLimits())
    return b.text(b.use("object"))


def tool_call_grammar(tools: Sequence[tuple[str, Any]], limits: GrammarLimits | None = None) -> str:
    """Exactly one `<tool_call>` block calling one of `tools` ((name, parameters schema) pairs).

    The opening and closing tags are string literals: llama.cpp matches grammar literals against
    token texts, so they accept the single special token `<tool_call>` as well as its spelling.
    """
    b = _Builder({}, "tools", limits or GrammarLimits())
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


async def built_off_loop(source: str, build: Callable[[], T], grammar_of: Callable[[T], str]) -> T:
    """Run a grammar build in a worker thread — converting a large schema takes long enough to stall
    every other request of the engine (and /health) if done on the event loop — logging
    `grammar.building` (debug), then `grammar.built` with its size and time, or `grammar.refused`."""
    log.debug("grammar.building", source=source)
    t0 = time.monotonic()
    try:
        result = await asyncio.to_thread(build)
    except BadRequest as exc:
        log.info("grammar.refused", source=source, error=exc.message)
        raise
    text = grammar_of(result)
    ms = round((time.monotonic() - t0) * 1000.0, 2)
    log.info("grammar.built", source=source, bytes=len(text), rules=text.count("\n"), ms=ms)
    return result

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

Forced tool calls are written in the model family's format: `calls_grammar` takes the family's
rule for one call (`hermes_call` here, the others in `formats/`), which builds on `GrammarBuilder`
(`text_without` for free text up to a closing tag). Every grammar can start with the end of a
reasoning block the prompt opened (`reasoning=True`): any text without `</think>`, then `</think>`.
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

from engine_pool.errors import BadRequest

from ..protocol.tool_grammar import TextGrammar
from .tool_input import input_expr

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

THINK_CLOSE = "</think>"

# A string schema holding a custom tool's input grammar under this key (a `TextGrammar`, which no
# JSON document can hold) is matched by that grammar: the engine builds such schemas for the tools
# whose input has a grammar (chat_request.ChatRequest.input_grammars), never a client.
INPUT_GRAMMAR = "x-slotkeeper-input-grammar"


def input_grammar(schema: Any) -> TextGrammar | None:
    """The custom tool input grammar a schema holds, if any."""
    found = schema.get(INPUT_GRAMMAR) if isinstance(schema, dict) else None
    return found if isinstance(found, TextGrammar) else None


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


class GrammarBuilder:
    """Builds one GBNF grammar: named rules, budgeted by `GrammarLimits`, from JSON schemas and text."""

    def __init__(self, root_schema: Any, where: str, limits: GrammarLimits) -> None:
        self.rules: dict[str, str] = {}
        self.root_schema = root_schema
        self.where = where
        self.refs: dict[str, str] = {}
        self.limits = limits
        self.size = 0  # bytes of the rules so far (names and bodies)
        self.visits = 0
        self._next: dict[str, int] = {}  # rule name base -> next suffix (no quadratic name search)
        self._without: dict[str, str] = {}  # stop string -> its text_without rule
        self._ends: dict[str, str] = {}  # closing tag -> the rule ending the block it closes

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

    def check_keywords(self, schema: dict[str, Any], path: str) -> None:
        """Refuse the keywords that constrain values in ways these grammars do not express."""
        unknown = sorted(k for k in schema if k not in _HANDLED and k not in _IGNORED)
        if unknown:
            raise self.fail(path, f"unsupported JSON schema keyword(s) {', '.join(unknown)}")

    def parameters(self, args: Any) -> tuple[dict[str, Any], set[str]]:
        """The properties (in order) and the required names of a tool's arguments schema, for the
        formats that write each argument on its own rather than as one JSON object."""
        if not isinstance(args, dict) or args.get("type", "object") != "object" or "$ref" in args:
            raise self.fail("", "a tool's parameters must be an object schema with 'properties'")
        self.check_keywords(args, "")
        props = args.get("properties", {})
        if not isinstance(props, dict):
            raise self.fail("", "'properties' must be an object")
        required = args.get("required", [])
        if not isinstance(required, list) or any(not isinstance(r, str) or r not in props for r in required):
            raise self.fail("", "'required' must list names from 'properties'")
        return props, set(required)

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
        if (g := input_grammar(schema)) is not None:  # a custom tool's input, as a JSON string
            return f'"\\"" {input_expr(self, g, hint, json_string=True)} "\\"" {self.use("space")}'
        if not isinstance(schema, dict):
            raise self.fail(path, f"a schema must be an object, got {type(schema).__name__}")
        self.check_keywords(schema, path)
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
        if isinstance(items, list):  # a tuple (draft 4's array form of `items`), as llama.cpp reads it
            return self.tuple(items, path, hint, depth)
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

    def tuple(self, items: list[Any], path: str, hint: str, depth: int) -> str:
        """Exactly one value per schema of `items`, in order."""
        sp = self.use("space")
        if not items:
            return f'"[" {sp} "]" {sp}'
        parts = [
            self.add(
                f"{hint}-tuple-{i}", self.visit(sub, f"{path}/items/{i}", f"{hint}-tuple-{i}", depth + 1)
            )
            for i, sub in enumerate(items)
        ]
        return f'"[" {sp} ' + f' "," {sp} '.join(parts) + f' "]" {sp}'

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
        opt = OptionalSequence(self, hint, [kvs[n] for n in props if n not in needed], f'"," {sp}')
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

    def for_tool(self, name: str, params: Any) -> Any:
        """Start on a tool's parameters: its `$ref`s resolve in its own schema and errors name it.
        Returns the schema of its arguments (a function declared without parameters takes none)."""
        self.root_schema, self.refs = (params if isinstance(params, dict) else {}), {}
        self.where = f"tools[{name}].function.parameters"
        return params if params else {"type": "object", "properties": {}}

    def text_without(self, stop: str) -> str:
        """A rule matching any text, the empty text too, in which `stop` does not occur.

        `stop` is a closing tag such as `</parameter>`: its first character occurs nowhere else in
        it, so after a mismatch only that character can restart a match. The rules are the states
        of the matcher (k = characters of `stop` matched so far); each is right-recursive, so
        llama.cpp's stacks do not grow with the text's length.
        """
        if len(stop) < 2 or stop[0] in stop[1:]:
            raise ValueError(f"text_without needs a closing tag, got {stop!r}")
        if stop in self._without:
            return self._without[stop]
        hint = "not-" + "".join(c for c in stop if c.isalnum())
        names = [self.add(hint, "") for _ in stop]  # reserved first: the states refer to each other
        head = _class_char(stop[0])
        for k, name in enumerate(names):
            other = f"[^{head}]" if k == 0 else f"[^{head}{_class_char(stop[k])}]"
            alts = [f"{other} {names[0]}", f"{literal(stop[0])} {names[1]}"]
            if 0 < k < len(stop) - 1:
                alts.append(f"{literal(stop[k])} {names[k + 1]}")
            body = "(" + " | ".join(alts) + ")?"
            self.size += len(body)
            self.rules[name] = body
        self.check_budget()
        self._without[stop] = names[0]
        return names[0]

    def reasoning_end(self) -> str:
        """The rest of a reasoning block the prompt opened: any text without `</think>`, then
        `</think>` and at most two newlines."""
        if THINK_CLOSE not in self._ends:
            body = f'{self.text_without(THINK_CLOSE)} {literal(THINK_CLOSE)} "\\n"{{0,2}}'
            self._ends[THINK_CLOSE] = self.add("reasoning", body)
        return self._ends[THINK_CLOSE]

    def text(self, root: str, *, reasoning: bool = False) -> str:
        """The grammar: `root`, after the end of an open reasoning block when `reasoning`."""
        if reasoning:
            root = f"{self.reasoning_end()} ({root})"
        self.size += len(root) + 10
        self.check_budget()
        lines = [f"root ::= {root}"] + [f"{k} ::= {v}" for k, v in self.rules.items()]
        return "\n".join(lines) + "\n"


class OptionalSequence:
    """Optional items `kvs` (in order) as a balanced tree of named rules.

    Any ordered subset of them may appear. `rest()` matches such a subset with the separator `sep`
    (a GBNF expression, `"," space` in JSON objects) before each (after required items); `first()`
    a non-empty subset without a leading separator (an object of optional properties only). Each
    node of the tree over `kvs[lo:hi]` is one rule built from its two halves, memoised, so every
    item appears a constant number of times — the flat form (for each item, "it first, then any of
    the rest") is quadratic in their number.
    """

    def __init__(self, b: GrammarBuilder, hint: str, kvs: list[str], sep: str) -> None:
        self.b, self.hint, self.kvs, self.sep = b, hint, kvs, sep
        self._rest: dict[tuple[int, int], str] = {}
        self._first: dict[tuple[int, int], str] = {}

    def rest(self, lo: int = 0, hi: int | None = None) -> str:
        hi = len(self.kvs) if hi is None else hi
        if hi - lo == 1:
            return f"({self.sep} {self.kvs[lo]})?"
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
    schema: Any,
    where: str = "response_format.json_schema.schema",
    limits: GrammarLimits | None = None,
    *,
    reasoning: bool = False,
) -> str:
    """A GBNF grammar whose sentences are JSON documents valid for `schema`, within `limits` (after
    the end of a reasoning block the prompt opened, when `reasoning`)."""
    b = GrammarBuilder(schema, where, limits or GrammarLimits())
    return b.text(b.visit(schema, "", "root"), reasoning=reasoning)


def json_object_grammar(*, reasoning: bool = False) -> str:
    """Any JSON object (response_format json_object)."""
    b = GrammarBuilder({}, "response_format", GrammarLimits())
    return b.text(b.use("object"), reasoning=reasoning)


# A family's GBNF for one call: (builder, tool name, schema of its arguments) -> expression.
CallRule = Callable[[GrammarBuilder, str, Any], str]


def calls_grammar(
    tools: Sequence[tuple[str, Any]],
    call: CallRule,
    limits: GrammarLimits | None = None,
    *,
    reasoning: bool = False,
    repeated: bool = False,
    lenient: Callable[[Any], Any] | None = None,
) -> str:
    """Exactly one call of one of `tools` ((name, parameters schema) pairs), written as `call` writes
    it, after the end of a reasoning block the prompt opened when `reasoning`; `repeated`: one or
    more calls, a newline at most between them. `lenient(parameters)`, when given, is the schema a
    tool whose own one the grammar cannot express is called with instead (None: refuse as well).

    Tags are string literals: llama.cpp matches grammar literals against token texts, so a literal
    accepts a tag that is one token of the vocabulary as well as its spelling.
    """
    b = GrammarBuilder({}, "tools", limits or GrammarLimits())
    alts = []
    for name, params in tools:
        try:
            alts.append(b.add(f"call-{name}", call(b, name, b.for_tool(name, params))))
        except BadRequest:
            fallback = lenient(params) if lenient is not None else None
            if fallback is None:
                raise
            alts.append(b.add(f"call-{name}", call(b, name, b.for_tool(name, fallback))))
    root = " | ".join(alts)
    if repeated:
        one = b.add("call", root)
        root = f'{one} ("\\n"? {one})*'
    return b.text(root, reasoning=reasoning)


def hermes_call(b: GrammarBuilder, name: str, args: Any) -> str:
    """One Hermes call: `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`."""
    head = literal('<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ')
    return f"{head} {b.visit(args, '', f'args-{name}')} {literal('}')} {literal(chr(10) + '</tool_call>')}"


def tool_call_grammar(
    tools: Sequence[tuple[str, Any]], limits: GrammarLimits | None = None, *, reasoning: bool = False
) -> str:
    """Exactly one Hermes `<tool_call>` block calling one of `tools` ((name, parameters schema) pairs)."""
    return calls_grammar(tools, hermes_call, limits, reasoning=reasoning)


def _class_char(c: str) -> str:
    """`c` inside a GBNF character class."""
    return {"\\": "\\\\", "]": "\\]", "[": "\\[", "^": "\\^", "-": "\\-", "\n": "\\n", "\r": "\\r"}.get(c, c)


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


@dataclass(frozen=True)
class GrammarTriggers:
    """How a grammar starts (llama.cpp's chat layer's tool-call grammars): `lazy`, it applies from
    the first match of a pattern (a regex over the generated text) or token on; `prefill`, tokens
    of the prompt it accepts before generation (the generation prompt it begins with)."""

    lazy: bool = False
    patterns: tuple[str, ...] = ()
    tokens: tuple[int, ...] = ()
    prefill: tuple[int, ...] = ()

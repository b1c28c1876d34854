"""Hypothesis strategies for request bodies, valid and hostile, derived from published schemas.

`cases(endpoint, model)` draws one `Case` (the bytes to POST) of three kinds:

- **valid**: a value of the endpoint's schema (gateway.bench.harness.fuzz_specs), naming the served
  model, with the fields that bound generation kept small;
- **mutated**: a valid one with one to three edits at any path — a hostile value put in (wrong type,
  null, huge or non-finite number, lone surrogate, deep nesting, a long array), a field deleted, an
  unknown field added, an array item made a non-object, a value wrapped in an array or object;
- **raw**: bytes that are not a JSON object at all (empty, truncated, invalid UTF-8, a BOM, UTF-16,
  an array, a number past Python's integer-string limit, nesting deeper than any parser's stack).

The schema walker understands what the OpenAPI documents use ($ref, allOf/anyOf/oneOf, type lists,
nullable, enum/const, properties/required/additionalProperties, items, numeric and length bounds)
and bounds depth and breadth, so a recursive schema still gives a small body.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from gateway.bench.harness.fuzz_specs import Endpoint, Schema

MAX_DEPTH = 6  # object/array levels with optional parts; past it only what is required, 3 more at most
MAX_OPTIONAL = 4  # optional properties drawn per object
MAX_ITEMS = 3


@dataclass(frozen=True)
class Raw:
    """JSON text put into a body as is (values `json.dumps` cannot write: 1e400, a 5000-digit int)."""

    text: str


@dataclass(frozen=True)
class Case:
    kind: str  # valid | mutated | raw
    body: bytes
    edits: tuple[str, ...] = ()  # what a mutated body had done to it, for the report

    def describe(self) -> str:
        return f"{self.kind}" + (f" ({'; '.join(self.edits)})" if self.edits else "")


def encode(value: Any, *, ascii_only: bool = True) -> bytes:
    """`value` as JSON bytes, `Raw` parts written as they are. Without `ascii_only` non-ASCII is
    written as UTF-8, and a lone surrogate as the (invalid) bytes it would take."""
    raws: list[str] = []

    def placeholders(v: Any) -> Any:
        if isinstance(v, Raw):
            raws.append(v.text)
            return f"\x00raw{len(raws) - 1}\x00"
        if isinstance(v, dict):
            return {k: placeholders(x) for k, x in v.items()}
        if isinstance(v, list):
            return [placeholders(x) for x in v]
        return v

    text = json.dumps(placeholders(value), ensure_ascii=ascii_only)
    for i, raw in enumerate(raws):
        quoted = json.dumps(f"\x00raw{i}\x00", ensure_ascii=ascii_only)
        text = text.replace(quoted, raw, 1)
    return text.encode("utf-8", "surrogatepass")


# ------------------------------------------------------------------------------- valid values
def _merged(schema: Schema, node: Mapping[str, Any]) -> Mapping[str, Any]:
    """An allOf node as one object node (properties and required united): what the specs use it for."""
    out: dict[str, object] = {k: v for k, v in node.items() if k != "allOf"}
    props: dict[str, object] = dict(node.get("properties") or {})
    required: list[str] = list(node.get("required") or [])
    for part in node.get("allOf") or []:
        if isinstance(part, Mapping) and "$ref" in part:
            part = schema.resolve(part["$ref"]) or {}
        if isinstance(part, Mapping):
            part = _merged(schema, part) if "allOf" in part else part
            props.update(part.get("properties") or {})
            required += list(part.get("required") or [])
            for k in ("type", "additionalProperties"):
                out.setdefault(k, part.get(k))
    if props:
        out["properties"] = props
        out.setdefault("type", "object")
    out["required"] = required
    return {k: v for k, v in out.items() if v is not None}


_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 100), st.text(max_size=12))
_ANY_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)

_URLS = ["https://example.com/a.png", "data:image/png;base64,iVBORw0KGgo=", "file:///etc/passwd"]


def _string(node: Mapping[str, Any]) -> st.SearchStrategy[Any]:
    fmt = node.get("format")
    if fmt == "uri":
        return st.sampled_from(_URLS)
    if fmt in ("byte", "base64"):
        return st.sampled_from(["aGVsbG8=", "", "not base64!"])
    lo = int(node.get("minLength") or 0)
    hi = max(lo, min(int(node.get("maxLength") or 24), 24))
    text = st.text(min_size=min(lo, 24), max_size=hi)
    examples = [e for e in node.get("examples") or [] if isinstance(e, str)]
    return st.sampled_from(examples) | text if examples else text


def _number(node: Mapping[str, Any], integer: bool) -> st.SearchStrategy[Any]:
    lo = node.get("minimum", node.get("exclusiveMinimum"))
    hi = node.get("maximum", node.get("exclusiveMaximum"))
    if integer:
        lo_i = int(lo) if isinstance(lo, int | float) else -5
        hi_i = int(hi) if isinstance(hi, int | float) else max(lo_i, 0) + 100
        return st.integers(lo_i, max(lo_i, min(hi_i, lo_i + 10**6)))
    lo_f = float(lo) if isinstance(lo, int | float) else -2.0
    hi_f = float(hi) if isinstance(hi, int | float) else max(lo_f, 0.0) + 2.0
    return st.floats(lo_f, max(lo_f, hi_f), allow_nan=False, allow_infinity=False)


def _object(schema: Schema, node: Mapping[str, Any], depth: int) -> st.SearchStrategy[Any]:
    props: Mapping[str, Any] = node.get("properties") or {}
    required = [k for k in node.get("required") or [] if k in props]
    optional = sorted(k for k in props if k not in required)
    extra = node.get("additionalProperties")

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, object]:
        keys = list(required)
        if optional and depth <= MAX_DEPTH:  # deeper: the required properties only
            keys += draw(st.lists(st.sampled_from(optional), max_size=MAX_OPTIONAL, unique=True))
        out = {k: draw(values(Schema(props[k], schema.doc), depth + 1)) for k in keys}
        if not props and isinstance(extra, Mapping | bool) and extra is not False:
            inner = values(Schema(extra, schema.doc), depth + 1) if isinstance(extra, Mapping) else _ANY_JSON
            out.update(draw(st.dictionaries(st.text(min_size=1, max_size=8), inner, max_size=MAX_ITEMS)))
        return out

    return build()


def values(schema: Schema, depth: int = 0) -> st.SearchStrategy[Any]:
    """Values of `schema.node` (valid as far as the walker understands the schema)."""
    node = schema.node
    if not isinstance(node, Mapping):
        return _ANY_JSON
    if "$ref" in node:
        target = schema.resolve(str(node["$ref"]))
        if target is None:
            return _SCALARS
        return st.deferred(lambda: values(Schema(target, schema.doc), depth))
    if "allOf" in node:
        return values(Schema(_merged(schema, node), schema.doc), depth)
    if "const" in node:
        return st.just(node["const"])
    if "enum" in node and node["enum"]:
        return st.sampled_from(list(node["enum"]))
    branches = [*(node.get("anyOf") or []), *(node.get("oneOf") or [])]
    if branches:
        return st.one_of([values(Schema(b, schema.doc), depth) for b in branches])
    kinds = node.get("type")
    if kinds is None:
        kinds = "object" if "properties" in node else "array" if "items" in node else None
    if isinstance(kinds, list):
        out: st.SearchStrategy[Any] = st.one_of(
            [values(Schema({**node, "type": k}, schema.doc), depth) for k in kinds]
        )
    elif kinds is None:
        out = _ANY_JSON
    elif depth > MAX_DEPTH + 3 and kinds in ("object", "array"):
        out = st.just({}) if kinds == "object" else st.just([])
    elif kinds == "object":
        out = _object(schema, node, depth)
    elif kinds == "array":
        items = node.get("items")
        lo = min(int(node.get("minItems") or 0), MAX_ITEMS if depth <= MAX_DEPTH else 1)
        inner = values(Schema(items, schema.doc), depth + 1) if isinstance(items, Mapping) else _ANY_JSON
        hi = min(int(node.get("maxItems") or MAX_ITEMS), MAX_ITEMS if depth <= MAX_DEPTH else lo)
        out = st.lists(inner, min_size=lo, max_size=max(lo, hi))
    elif kinds == "string":
        out = _string(node)
    elif kinds in ("integer", "number"):
        out = _number(node, kinds == "integer")
    elif kinds == "boolean":
        out = st.booleans()
    else:
        out = st.none()
    return st.none() | out if node.get("nullable") else out


# ------------------------------------------------------------------------------ hostile values
_DEEP = Raw("[" * 100 + "]" * 100)
_DEEPER = Raw('{"a":' * 3000 + "1" + "}" * 3000)
HOSTILE_SCALARS: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1.5,
    -0.0,
    2**31,
    2**63,
    2**64,
    -(2**63) - 1,
    10**30,
    Raw("1e400"),
    Raw("-1e400"),
    Raw("1e-400"),
    Raw("NaN"),
    Raw("Infinity"),
    Raw("-Infinity"),
    Raw("1" * 5000),
    Raw("-" + "9" * 4400),
    Raw("1." + "0" * 5000),
    "",
    " ",
    "\x00",
    "\ud800",
    "\udfff",
    "a\ud83d",
    "\u202e\u2066",
    "🦙" * 3,
    "\r\n\t",
    "{{ raise_exception('x') }}",
    "{% for x in range(99999999) %}{% endfor %}",
    "<|im_start|>",
    "<tool_call>",
    "../../../etc/passwd",
    "%s%n%x",
    "null",
    "0",
    "true",
    "[]",
    "{}",
    "x" * 70_000,
]
HOSTILE_CONTAINERS: list[Any] = [
    [],
    {},
    [None],
    [1],
    ["x"],
    [[]],
    [{}],
    [[[[]]]],
    {"": None},
    {"__proto__": {}},
    {"0": 0},
    [True, "x", 1.5, None, {}, []],
    _DEEP,
    _DEEPER,
    list(range(2000)),
    ["x"] * 500,
    {f"k{i}": i for i in range(300)},
    [{"type": "text"}],
    [{"type": None}],
]


def hostile() -> st.SearchStrategy[Any]:
    return st.sampled_from(HOSTILE_SCALARS) | st.sampled_from(HOSTILE_CONTAINERS) | _ANY_JSON


# ----------------------------------------------------------------------------------- mutations
Path = tuple[str | int, ...]


def paths(value: Any, at: Path = ()) -> list[Path]:
    """Every path in `value` (root first), not descending into `Raw` parts."""
    out = [at]
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths(v, (*at, i))
    return out


def _get(value: Any, path: Path) -> Any:
    for p in path:
        value = value[p]
    return value


def _put(value: Any, path: Path, new: Any) -> Any:
    """A copy of `value` with the node at `path` replaced by `new` (the rest shared)."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _put(value[head], rest, new)}
    copy = list(value)
    copy[head] = _put(value[head], rest, new)  # type: ignore[index]
    return copy


EDITS = ("replace", "replace", "replace", "delete", "extra", "non-object items", "wrap", "swap", "repeat")


@st.composite
def mutated(draw: st.DrawFn, base: Any) -> tuple[Any, tuple[str, ...]]:
    """`base` with one to three edits (and what they were)."""
    body, notes = base, []
    for _ in range(draw(st.integers(1, 3))):
        where = paths(body)
        path = draw(st.sampled_from(where))
        edit = draw(st.sampled_from(EDITS))
        node = _get(body, path)
        label = "/" + "/".join(map(str, path))
        if edit == "delete" and path:
            parent = _get(body, path[:-1])
            if isinstance(parent, dict):
                body = _put(body, path[:-1], {k: v for k, v in parent.items() if k != path[-1]})
            else:
                body = _put(body, path[:-1], [v for i, v in enumerate(parent) if i != path[-1]])
        elif edit == "extra" and isinstance(node, dict):
            key = draw(
                st.sampled_from(
                    [
                        "x_unknown",
                        "",
                        "stream",
                        "model",
                        "messages",
                        "tool_calls",
                        "type",
                        "role",
                        "content",
                        "id_slot",
                        "n_probs",
                    ]
                )
            )
            body = _put(body, path, {**node, key: draw(hostile())})
        elif edit == "non-object items" and isinstance(node, list):
            items = [draw(st.sampled_from(HOSTILE_SCALARS[:12] + ["x", "", [], [[]]])) for _ in node or [0]]
            body = _put(body, path, items)
        elif edit == "wrap":
            body = _put(body, path, draw(st.sampled_from([[node], {"value": node}, [node, node]])))
        elif edit == "swap":
            other = _get(body, draw(st.sampled_from(where)))
            body = _put(body, path, other)
        elif edit == "repeat" and isinstance(node, list) and node:
            body = _put(body, path, node * draw(st.sampled_from([2, 50, 400])))
        else:
            edit = "replace"
            body = _put(body, path, draw(hostile()))
        notes.append(f"{edit} {label}")
    return body, tuple(notes)


RAW_BODIES: list[bytes] = [
    b"",
    b" ",
    b"{",
    b"}",
    b"{}",
    b"[]",
    b"null",
    b"0",
    b'"x"',
    b"[{}]",
    b"{}{}",
    b'{"a":1}x',
    b"\xff\xfe{}",
    b"\xef\xbb\xbf{}",
    '{"model":"m"}'.encode("utf-16"),
    b'{"a":"\xff"}',
    b"\x00",
    b'{"a":1,"a":2}',
    b"{'a': 1}",
    b'{"a":NaN}',
    b"[" * 100_000,
    b'{"a":' * 50_000,
    b"1" * 5000,
    b'{"messages":' + b"1" * 5000 + b"}",
    b'{"prompt":"' + b"\\ud800" + b'"}',
    b"\n\n\n",
]


# ------------------------------------------------------------------------------------- bodies
def _bounded(body: Any, endpoint: Endpoint, model: str | None) -> Any:
    """A valid body made cheap and routable: generation bounds small, the served model named."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for name in endpoint.bounded:
        if name in body or name in ("max_tokens", "n_predict", "max_output_tokens"):
            body[name] = min(body[name], 4) if isinstance(body.get(name), int) and body[name] > 0 else 2
    for name in ("n", "best_of", "top_logprobs", "logprobs", "n_probs", "n_cmpl"):
        if isinstance(body.get(name), int) and not isinstance(body[name], bool) and body[name] > 2:
            body[name] = 2
    if model is not None and endpoint.models:
        body["model"] = model
    return body


def _requiring(schema: Schema, needs: tuple[str, ...]) -> Schema:
    """The body schema (its `$ref`s and `allOf` followed) with `needs` required too."""
    node = schema.node
    while "$ref" in node and (target := schema.resolve(str(node["$ref"]))) is not None:
        node = target
    node = _merged(schema, node) if "allOf" in node else node
    return Schema({**node, "required": [*(node.get("required") or []), *needs]}, schema.doc)


def valid_bodies(endpoint: Endpoint, model: str | None) -> st.SearchStrategy[Any]:
    schema = _requiring(endpoint.schema(), endpoint.needs) if endpoint.needs else endpoint.schema()
    names = st.sampled_from([model] * 6 + [None]) if model is not None else st.just(None)
    return st.tuples(values(schema), names).map(lambda bm: _bounded(bm[0], endpoint, bm[1]))


def cases(endpoint: Endpoint, model: str | None) -> st.SearchStrategy[Case]:
    """Bodies for `endpoint`: a quarter valid, five eighths mutated, the rest raw bytes."""
    valid = valid_bodies(endpoint, model)
    ascii_only = st.booleans()
    as_valid = st.tuples(valid, ascii_only).map(lambda v: Case("valid", encode(v[0], ascii_only=v[1])))
    as_mutated = st.tuples(valid.flatmap(mutated), ascii_only).map(
        lambda v: Case("mutated", encode(v[0][0], ascii_only=v[1]), v[0][1])
    )
    as_raw = st.sampled_from(RAW_BODIES).map(lambda b: Case("raw", b))
    return st.one_of(as_valid, as_valid, *[as_mutated] * 5, as_raw)

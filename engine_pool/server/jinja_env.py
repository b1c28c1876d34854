"""The jinja language chat templates are written in, as the engines that serve them run it.

Published templates are written for Hugging Face's jinja2 sandbox and tested on llama.cpp's own
jinja engine (which llama-server renders them with); each accepts some things the other refuses.
This sandboxed jinja2 environment takes what templates in the wild rely on:

- `tojson` is plain JSON (not jinja2's HTML-escaped Markup), `from_json` parses a JSON text, and both
  take the lists that filters produce; `raise_exception` and `strftime_now` are globals;
- `{% generation %}…{% endgeneration %}` (Hugging Face's marker of the assistant's tokens for
  training masks) renders its body;
- a template may build lists and mappings of its own (`list.append`, `dict.update`): the sandbox
  still refuses every attribute that reaches Python internals;
- `map`, `select`, `reject`, `selectattr`, `rejectattr` give lists (jinja2 gives generators, which
  `length`, indexing and `tojson` refuse);
- an attribute of an undefined value is undefined (llama.cpp: a template may test
  `message.tool_calls.x` on a message without calls), it renders as nothing and `tojson` writes it
  as null;
- `+` with a string on one side joins a number, a bool (`True`/`False`), None or undefined (as
  nothing) to it, as llama.cpp does; anything else follows Python (a mapping plus a string is an
  error).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.runtime import Context
from jinja2.sandbox import SandboxedEnvironment, SecurityError


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _plain(value: Any) -> Any:
    """`value` as JSON can write it: undefined → None, iterators → lists, mappings kept."""
    if isinstance(value, jinja2.Undefined):
        return None
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Iterator):
        return [_plain(v) for v in value]
    return value


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, **_: Any) -> str:
    # Like the HF/llama.cpp `tojson`: plain JSON, not jinja2's HTML-escaped Markup.
    return json.dumps(_plain(value), indent=indent, ensure_ascii=ensure_ascii)


def _from_json(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError as exc:
        raise jinja2.TemplateError(f"from_json: not a JSON text: {exc}") from None


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Generation(Extension):
    """`{% generation %}…{% endgeneration %}`: the body, rendered in place."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _Undefined(jinja2.ChainableUndefined):
    """Undefined whose attributes are undefined too; it renders as nothing and iterates as empty."""


def _string_side(value: Any) -> str | None:
    """What `value` joins to a string as (llama.cpp's concatenation), None when it does not."""
    if value is None or isinstance(value, jinja2.Undefined):
        return ""
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, int | float):
        return str(value)
    return None


class TemplateEnvironment(SandboxedEnvironment):
    intercepted_binops = frozenset({"+"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        # Refused outright: an undefined that chains would render Python internals' probes as "".
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "+":
            if isinstance(left, str) and not isinstance(right, str):
                other = _string_side(right)
                if other is not None:
                    return left + other
            elif isinstance(right, str) and not isinstance(left, str):
                other = _string_side(left)
                if other is not None:
                    return other + right
        return super().call_binop(context, operator, left, right)


def _listed(filter_: Callable[..., Any]) -> Callable[..., Any]:
    def listed(*args: Any, **kwargs: Any) -> Any:
        out = filter_(*args, **kwargs)
        return list(out) if isinstance(out, Iterable) and not isinstance(out, str | Mapping) else out

    # Context and environment filters keep their pass_* mark.
    if hasattr(filter_, "jinja_pass_arg"):
        listed.jinja_pass_arg = filter_.jinja_pass_arg  # type: ignore[attr-defined]
    return listed


def environment() -> TemplateEnvironment:
    env = TemplateEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _Generation],
        undefined=_Undefined,
    )
    for name in ("map", "select", "reject", "selectattr", "rejectattr"):
        env.filters[name] = _listed(env.filters[name])
    env.filters["tojson"] = _tojson
    env.filters["from_json"] = _from_json
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env

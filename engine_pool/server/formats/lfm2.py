"""LFM2 / LFM2.5 tool calls: Python call syntax between `<|tool_call_start|>` and `<|tool_call_end|>`.

    <|tool_call_start|>[get_weather(city="Paris", days=3), get_time(tz='utc')]<|tool_call_end|>

Liquid's templates list the tools as JSON in the system turn (`List of tools:
<|tool_list_start|>[...]<|tool_list_end|>`); the model answers with a list of calls, several in one
block if it likes. Arguments are keyword arguments whose values are Python or JSON literals,
since the templates render history both ways: strings in double quotes (read as JSON strings) or
single quotes (Python's escapes), numbers, `true`/`false`/`null` or `True`/`False`/`None`, and
lists, tuples and dicts of those. Anything else — a positional argument, an expression, text after
the list — makes the block not a call block.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..grammar import GrammarBuilder, OptionalSequence, literal
from .calls import ToolCall, arguments_json

OPEN = "<|tool_call_start|>"
CLOSE = "<|tool_call_end|>"
# A template of the family: it writes calls, or lists the tools the way Liquid's templates do (the
# LFM2.5 instruct template leaves the calls to the assistant's content).
MARKERS = ((OPEN,), ("<|tool_list_start|>",), ("List of tools: [",))
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_WORDS = {"true": True, "True": True, "false": False, "False": False, "null": None, "None": None}
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "0": "\0", "\\": "\\", "'": "'", '"': '"'}
_JSON = json.JSONDecoder(strict=False)  # strict=False: a newline may stand in a string as it is
_MAX_DEPTH = 64  # nesting of values; deeper is not a call (and would exhaust Python's stack)


class _Malformed(Exception):
    pass


def parse_block(block: str, schemas: Mapping[str, Any]) -> list[ToolCall] | None:
    """The calls in the text between the tags, or None when it is not a call block (the values
    carry their own types: the tools' schemas are not needed)."""
    try:
        return _Reader(block).calls() or None
    except _Malformed:
        return None


def call_grammar(b: GrammarBuilder, name: str, args: Any) -> str:
    """One call of `name` in a one-element list: keyword arguments in declared order, the required
    ones always, values as JSON (which the reader takes as Python literals too)."""
    if not _NAME.fullmatch(name):
        raise b.fail("", "a function name must be a Python-like identifier in this format")
    props, required = b.parameters(args)
    kvs = {}
    for key, sub in props.items():
        if not _NAME.fullmatch(key):
            raise b.fail(
                f"/properties/{key}", "a parameter name must be a Python-like identifier in this format"
            )
        value = b.visit(sub, f"/properties/{key}", f"{name}-{key}", 2)
        kvs[key] = b.add(f"{name}-{key}-kv", f"{literal(key + '=')} {value}")
    sep = literal(", ")
    req = [kvs[k] for k in props if k in required]
    opt = OptionalSequence(b, f"{name}-args", [kvs[k] for k in props if k not in required], sep)
    if req:
        body = f" {sep} ".join(req) + (f" {opt.rest()}" if opt.kvs else "")
    else:
        body = f"({opt.first()})?" if opt.kvs else ""
    return f"{literal(f'{OPEN}[{name}(')} {body} {literal(f')]{CLOSE}')}"


class _Reader:
    """A recursive-descent reader of `[name(key=value, ...), ...]`."""

    def __init__(self, text: str) -> None:
        self.s, self.i, self.depth = text, 0, 0

    def calls(self) -> list[ToolCall]:
        self._ws()
        bracket = self._eat("[")
        calls = []
        if not (bracket and self._eat("]")):
            while True:
                calls.append(self._call())
                if not self._eat(","):
                    break
            if bracket:
                self._expect("]")
        self._ws()
        if self.i != len(self.s):
            raise _Malformed("text after the calls")
        return calls

    def _call(self) -> ToolCall:
        name = self._name()
        self._expect("(")
        args: dict[str, Any] = {}
        if not self._eat(")"):
            while True:
                key = self._name()
                self._expect("=")
                args[key] = self._value()
                if not self._eat(","):
                    self._expect(")")
                    break
                if self._eat(")"):  # a trailing comma
                    break
        return ToolCall(name, arguments_json(args))

    def _value(self) -> Any:
        self._ws()
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise _Malformed("nested too deeply")
        c = self.s[self.i : self.i + 1]
        if c in ("'", '"'):
            value: Any = self._string(c)
        elif c in ("[", "("):
            self.i += 1
            value = self._items("]" if c == "[" else ")")
        elif c == "{":
            self.i += 1
            value = self._dict()
        else:
            value = self._scalar()
        self.depth -= 1
        self._ws()
        return value

    def _items(self, end: str) -> list[Any]:
        items: list[Any] = []
        while not self._eat(end):
            items.append(self._value())
            if not self._eat(","):
                self._expect(end)
                break
        return items

    def _dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        while not self._eat("}"):
            key = self._value()
            if not isinstance(key, str):
                raise _Malformed("a dict key that is not a string")
            self._expect(":")
            out[key] = self._value()
            if not self._eat(","):
                self._expect("}")
                break
        return out

    def _scalar(self) -> Any:
        m = _NUMBER.match(self.s, self.i)
        if m is not None:
            self.i = m.end()
            text = m.group()
            try:  # Python refuses integers of more than 4300 digits
                number = int(text) if text.lstrip("-").isdigit() else float(text)
            except ValueError:
                raise _Malformed("a number too long") from None
            if isinstance(number, float) and not math.isfinite(number):
                raise _Malformed("a number JSON cannot hold")
            return number
        word = _NAME.match(self.s, self.i)
        if word is None or word.group() not in _WORDS:
            raise _Malformed("not a literal")
        self.i = word.end()
        return _WORDS[word.group()]

    def _string(self, quote: str) -> str:
        if quote == '"':
            try:
                value, self.i = _JSON.raw_decode(self.s, self.i)
                return str(value)
            except json.JSONDecodeError:
                pass  # not a JSON string (a Python escape such as \'): read it as Python's
        out = []
        i = self.i + 1
        while i < len(self.s) and self.s[i] != quote:
            c = self.s[i]
            if c == "\\" and i + 1 < len(self.s):
                c, i = self._escape(i + 1)
            else:
                i += 1
            out.append(c)
        if i >= len(self.s):
            raise _Malformed("an unterminated string")
        self.i = i + 1
        text = "".join(out)
        try:  # \uXXXX pairs written separately are one character
            return text.encode("utf-16", "surrogatepass").decode("utf-16")
        except UnicodeDecodeError:
            return text

    def _escape(self, i: int) -> tuple[str, int]:
        """The character an escape at `i` (after the backslash) stands for, and where it ends."""
        c = self.s[i]
        width = {"u": 4, "x": 2}.get(c)
        if width is not None:
            digits = self.s[i + 1 : i + 1 + width]
            if len(digits) == width and all(d in "0123456789abcdefABCDEF" for d in digits):
                return chr(int(digits, 16)), i + 1 + width
        return _ESCAPES.get(c, "\\" + c), i + 1

    def _name(self) -> str:
        self._ws()
        m = _NAME.match(self.s, self.i)
        if m is None:
            raise _Malformed("a name was expected")
        self.i = m.end()
        return m.group()

    def _ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i].isspace():
            self.i += 1

    def _eat(self, c: str) -> bool:
        self._ws()
        if self.s.startswith(c, self.i):
            self.i += len(c)
            return True
        return False

    def _expect(self, c: str) -> None:
        if not self._eat(c):
            raise _Malformed(f"{c!r} was expected")


def write_calls(calls: Sequence[tuple[str, Any]]) -> str:
    """Calls ((name, arguments) pairs) in one block, keyword values as JSON literals."""
    written = []
    for name, args in calls:
        kwargs = ", ".join(
            f"{key}={json.dumps(value, ensure_ascii=False)}"
            for key, value in (args.items() if isinstance(args, dict) else ())
        )
        written.append(f"{name}({kwargs})")
    return f"{OPEN}[{', '.join(written)}]{CLOSE}"

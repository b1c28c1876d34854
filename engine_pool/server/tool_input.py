"""A custom tool's input grammar (engine_pool.protocol.tool_grammar) as GBNF rules of a
`grammar.GrammarBuilder`, in the form the model writes the input inside a call.

A chat format writes the input of a call either raw (Qwen3-Coder XML: the text between
`<parameter=input>` and `</parameter>`, as it is) or as the content of a JSON string (Hermes,
Nemotron-H, LFM2: between the quotes, escaped). `input_expr` writes the grammar's language in
either form: raw, every literal and class as it is; as JSON, every character in the one spelling
`json.dumps` gives it (`\\"`, `\\\\`, `\\n`..., `\\u00XX` for the other control characters, the
rest as itself), so that the decoded input is exactly a sentence of the grammar.

Rules of the grammar become named rules of the builder (reserved first: rules refer to each
other); what a repetition repeats is a named rule too, so that llama.cpp's parser expands `x{m,n}`
into n small rules and never multiplies nested repetitions. Everything is budgeted by the builder's
`GrammarLimits`. Every character goes into the GBNF text escaped unless it is printable, so no
control character (NUL above all: llama.cpp reads a C string) reaches the grammar's text.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from ..protocol.tool_grammar import Alt, Chars, Lit, Node, Ranges, Ref, Rep, Seq, TextGrammar, complement

if TYPE_CHECKING:
    from .grammar import GrammarBuilder

# Characters JSON strings escape: the control characters, the quote and the backslash.
_JSON_SPECIAL: Ranges = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C))
_NAMED_CLASS = 8  # a class of more ranges than this is a rule of its own, written once


def _char(cp: int) -> str:
    """One code point inside a GBNF class or literal: printable ASCII letters and digits as they
    are, everything else as a hex escape (llama.cpp's `\\xHH`, `\\uHHHH`, `\\UHHHHHHHH`)."""
    c = chr(cp)
    if c.isascii() and c.isalnum():
        return c
    if cp < 0x100:
        return f"\\x{cp:02X}"
    return f"\\u{cp:04X}" if cp < 0x10000 else f"\\U{cp:08X}"


def gbnf_literal(text: str) -> str:
    """A GBNF literal matching `text` exactly: printable characters as they are (but the quote and
    the backslash), control characters and DEL as hex escapes."""
    out = []
    for c in text:
        cp = ord(c)
        if c in '"\\':
            out.append("\\" + c)
        elif cp < 0x20 or cp == 0x7F:
            out.append(f"\\x{cp:02X}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def _class(ranges: Ranges) -> str:
    """A GBNF class listing `ranges`. Never negated: llama.cpp decodes UTF-8 leniently (a byte
    0xF8-0xFF starts a "character" past U+10FFFF), and a negated class would admit such bytes, which
    no text holds; a listed one ends at U+10FFFF and skips the surrogates."""
    return "[" + "".join(_char(lo) if lo == hi else f"{_char(lo)}-{_char(hi)}" for lo, hi in ranges) + "]"


def _intersect(a: Ranges, b: Ranges) -> Ranges:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def _json_escape(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


class _Writer:
    def __init__(self, b: GrammarBuilder, hint: str, json_string: bool) -> None:
        self.b, self.hint, self.json = b, hint, json_string
        self.names: dict[str, str] = {}
        self.classes: dict[Ranges, str] = {}

    def grammar(self, g: TextGrammar) -> str:
        for rule in g.rules:  # reserved first: rules refer to each other
            self.names[rule] = self.b.add(f"{self.hint}-{rule}", "")
        for rule, node in g.rules.items():
            body = self.expr(node)
            self.b.size += len(body)
            self.b.rules[self.names[rule]] = body
            self.b.check_budget()
        return self.names[g.start]

    def expr(self, node: Node) -> str:
        self.b.visits += 1
        self.b.check_budget()
        if isinstance(node, Lit):
            return gbnf_literal(_json_escape(node.text) if self.json else node.text)
        if isinstance(node, Chars):
            return self.chars(node.ranges)
        if isinstance(node, Ref):
            return self.names[node.name]
        if isinstance(node, Seq):
            return " ".join(self.expr(n) for n in node.items) if node.items else '""'
        if isinstance(node, Alt):
            return "(" + " | ".join(self.expr(n) for n in node.items) + ")"
        return self.repeat(node)

    def repeat(self, node: Rep) -> str:
        item = node.item
        if item == Lit("") or item == Seq(()):
            return '""'  # repeating nothing is nothing (and llama.cpp refuses `""*`)
        inner = self.expr(item)
        if not isinstance(item, Ref | Lit | Chars):  # (a class is one symbol: `chars` names groups)
            inner = self.b.add(f"{self.hint}-rep", inner)  # one symbol: llama.cpp multiplies groups
        lo, hi = node.lo, node.hi
        if (lo, hi) == (0, None):
            op = "*"
        elif (lo, hi) == (1, None):
            op = "+"
        elif (lo, hi) == (0, 1):
            op = "?"
        elif hi is None:
            op = f"{{{lo},}}"
        else:
            op = f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"
        return f"{inner}{op}"

    def chars(self, ranges: Ranges) -> str:
        if ranges in self.classes:
            return self.classes[ranges]
        if not self.json:
            text = _class(ranges)
        else:
            alts = []
            plain = _intersect(ranges, complement(_JSON_SPECIAL))
            if plain:
                alts.append(_class(plain))
            for lo, hi in _intersect(ranges, _JSON_SPECIAL):
                alts += [gbnf_literal(_json_escape(chr(cp))) for cp in range(lo, hi + 1)]
            text = alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"
        if len(ranges) > _NAMED_CLASS or (self.json and text.startswith("(")):
            text = self.b.add(f"{self.hint}-chars", text)
            self.classes[ranges] = text
        return text


def input_expr(b: GrammarBuilder, g: TextGrammar, hint: str, *, json_string: bool) -> str:
    """A GBNF expression (a rule name) matching the sentences of `g`: as they are, or (`json_string`)
    as the content of a JSON string, without its quotes."""
    return _Writer(b, hint, json_string).grammar(g)

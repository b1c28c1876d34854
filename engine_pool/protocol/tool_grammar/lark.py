"""Lark grammars (the subset the package reads) as rules of the tree. Pure."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from engine_pool.errors import BadRequest

from .regex import ESCAPES, HEX, read_regex
from .tree import (
    EMPTY,
    MAX_CHAR,
    MAX_NESTING,
    MAX_RULES,
    SURROGATES,
    Alt,
    Budget,
    Chars,
    Lit,
    Node,
    Ref,
    Rep,
    Seq,
    TextGrammar,
    alt,
    normalised,
    seq,
)

# Lark's `common` module, the terminals it is imported for, in Lark's own syntax (ESCAPED_STRING
# without its lookbehind: a double-quoted string with backslash escapes and no newline).
COMMON = {
    "DIGIT": '"0".."9"',
    "HEXDIGIT": '"a".."f" | "A".."F" | DIGIT',
    "INT": "DIGIT+",
    "SIGNED_INT": '["+" | "-"] INT',
    "DECIMAL": 'INT "." INT? | "." INT',
    "_EXP": '("e" | "E") SIGNED_INT',
    "FLOAT": "INT _EXP | DECIMAL _EXP?",
    "SIGNED_FLOAT": '["+" | "-"] FLOAT',
    "NUMBER": "FLOAT | INT",
    "SIGNED_NUMBER": '["+" | "-"] NUMBER',
    "ESCAPED_STRING": r'/"([^"\\\n]|\\.)*"/',
    "LCASE_LETTER": '"a".."z"',
    "UCASE_LETTER": '"A".."Z"',
    "LETTER": "UCASE_LETTER | LCASE_LETTER",
    "WORD": "LETTER+",
    "CNAME": '("_" | LETTER) ("_" | LETTER | DIGIT)*',
    "WS_INLINE": r'(" " | /\t/)+',
    "WS": r"/[ \t\f\r\n]/+",
    "CR": r"/\r/",
    "LF": r"/\n/",
    "NEWLINE": "(CR? LF)+",
    "SH_COMMENT": r"/#[^\n]*/",
    "CPP_COMMENT": r"/\/\/[^\n]*/",
    "SQL_COMMENT": r"/--[^\n]*/",
}

_TOKEN = re.compile(
    r"""
    (?P<ws>[ \t\f\r]+|\\\n)
  | (?P<comment>//[^\n]*)
  | (?P<nl>\n)
  | (?P<directive>%[a-z]+)
  | (?P<string>"(?:\\.|[^"\\\n])*"i?)
  | (?P<regex>/(?:\\.|[^/\\\n])+/[a-z]*)
  | (?P<name>[?!]?_?[A-Za-z][A-Za-z_0-9]*|[?!]?_+[A-Za-z0-9][A-Za-z_0-9]*)
  | (?P<number>\d+)
  | (?P<arrow>->)
  | (?P<dots>\.\.)
  | (?P<punct>[:|()\[\]?*+~.{},])
    """,
    re.VERBOSE,
)


@dataclass(frozen=True)
class _Tok:
    kind: str
    text: str
    at: int


def _tokens(text: str, budget: Budget) -> list[_Tok]:
    out, i = [], 0
    while i < len(text):
        m = _TOKEN.match(text, i)
        if m is None:
            raise budget.fail(f"unexpected {text[i]!r} at offset {i}")
        kind = m.lastgroup
        assert kind is not None
        if kind not in ("ws", "comment"):
            out.append(_Tok(kind, m.group(), i))
            budget.node()
        i = m.end()
    out.append(_Tok("nl", "\n", len(text)))
    out.append(_Tok("end", "", len(text)))
    return out


def _unquote(token: _Tok, budget: Budget) -> str:
    """A Lark string literal's text (Python's string escapes; an unknown one stays as written)."""
    body = token.text[1:-1] if not token.text.endswith("i") else token.text[1:-2]
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        e = body[i + 1]
        if e in ESCAPES:
            out.append(ESCAPES[e])
            i += 2
        elif e in '"\\':
            out.append(e)
            i += 2
        elif e in HEX:
            digits = body[i + 2 : i + 2 + HEX[e]]
            if len(digits) != HEX[e] or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise budget.fail(f"'\\{e}' needs {HEX[e]} hex digits at offset {token.at + i + 1}")
            cp = int(digits, 16)
            if cp > MAX_CHAR or SURROGATES[0] <= cp <= SURROGATES[1]:
                raise budget.fail(f"'\\{e}{digits}' is not a character at offset {token.at + i + 1}")
            out.append(chr(cp))
            i += 2 + HEX[e]
        else:
            out.append(c + e)
            i += 2
    return "".join(out)


class _Lark:
    """A reader of Lark grammars (the subset above) into rules of the tree."""

    def __init__(self, text: str, budget: Budget) -> None:
        self.toks = _tokens(text, budget)
        self.k = 0
        self.b = budget
        self.rules: dict[str, Node] = {}
        self.defined_at: dict[str, int] = {}
        self.refs: dict[str, int] = {}  # name -> where first referred to
        self.imports: dict[str, str] = {}  # local name -> COMMON name

    @property
    def tok(self) -> _Tok:
        return self.toks[self.k]

    def fail(self, what: str, tok: _Tok | None = None) -> BadRequest:
        return self.b.fail(f"{what} at offset {(tok or self.tok).at}")

    def take(self, kind: str, text: str | None = None) -> _Tok:
        tok = self.tok
        if tok.kind != kind or (text is not None and tok.text != text):
            want = repr(text) if text is not None else {"nl": "the end of a line"}.get(kind, f"a {kind}")
            got = "the end of a line" if tok.kind == "nl" else repr(tok.text) if tok.text else "the end"
            raise self.fail(f"expected {want}, got {got}")
        self.k += 1
        return tok

    def at(self, kind: str, text: str | None = None) -> bool:
        return self.tok.kind == kind and (text is None or self.tok.text == text)

    def skip_newlines(self) -> None:
        while self.at("nl"):
            self.k += 1

    def parse(self) -> TextGrammar:
        while True:
            self.skip_newlines()
            if self.at("end"):
                break
            if self.at("directive"):
                self.directive()
            else:
                self.definition()
        self.resolve_imports()
        if "start" not in self.rules:
            raise self.b.fail("a Lark grammar needs a 'start' rule")
        for name, at in self.refs.items():
            if name not in self.rules:
                raise self.b.fail(f"{name!r} is used at offset {at} but never defined")
        if len(self.rules) > MAX_RULES:
            raise self.b.limit(f"the grammar has more than {MAX_RULES} rules", MAX_RULES)
        return TextGrammar("lark", self.rules, "start")

    def directive(self) -> None:
        tok = self.take("directive")
        if tok.text != "%import":
            why = {
                "%ignore": "(text skipped between tokens) is not supported",
                "%declare": "(terminals a lexer callback makes) is not supported",
            }.get(tok.text, "is not supported")
            raise self.fail(f"the directive '{tok.text}' {why}", tok)
        module = self.take("name")
        names: list[tuple[str, str]] = []
        if self.at("punct", "."):
            self.k += 1
            name = self.take("name").text
            alias = name
            if self.at("arrow"):
                self.k += 1
                alias = self.take("name").text
            names.append((name, alias))
            where = module.text
        else:
            where = module.text
            self.take("punct", "(")
            while True:
                names.append((self.take("name").text,) * 2)  # type: ignore[arg-type]
                if self.at("punct", ")"):
                    self.k += 1
                    break
                self.take("punct", ",")
        if where != "common":
            raise self.fail(f"'%import {where}': only Lark's 'common' module can be imported", module)
        for name, alias in names:
            if name not in COMMON:
                raise self.fail(
                    f"'common.{name}' is not among the terminals this server imports "
                    f"({', '.join(sorted(n for n in COMMON if not n.startswith('_')))})",
                    module,
                )
            self.define(alias, module.at)
            self.imports[alias] = name
        self.take("nl")

    def define(self, name: str, at: int) -> None:
        if name in self.defined_at:
            raise self.b.fail(f"{name!r} is defined twice (at offsets {self.defined_at[name]} and {at})")
        self.defined_at[name] = at

    def definition(self) -> None:
        tok = self.take("name")
        name = tok.text.lstrip("?!")
        if self.at("punct", "{"):
            raise self.fail("templates ('name{...}') are not supported")
        if self.at("punct", "."):  # a priority: it orders lexer or parser choices, not the language
            self.k += 1
            self.take("number")
        self.take("punct", ":")
        self.define(name, tok.at)
        self.rules[name] = self.expansions(0)
        self.take("nl")

    def expansions(self, depth: int) -> Node:
        if depth > MAX_NESTING:
            raise self.b.limit(f"groups nest deeper than {MAX_NESTING}", MAX_NESTING)
        alts = [self.alias(depth)]
        while True:
            k = self.k
            if depth == 0:  # a rule's alternatives may go on over the next lines, each after a '|'
                self.skip_newlines()
            if self.at("punct", "|"):
                self.k += 1
                alts.append(self.alias(depth))
            else:
                self.k = k
                return alt(alts)

    def alias(self, depth: int) -> Node:
        items: list[Node] = []
        while True:
            if depth > 0:
                self.skip_newlines()
            if self.at("arrow"):
                self.k += 1
                self.take("name")
                break
            if self.at("nl") or self.at("end") or self.at("punct", "|") or self.at("punct", ")"):
                break
            if self.at("punct", "]"):
                break
            items.append(self.expr(depth))
            self.b.node()
        return seq(items) if items else EMPTY

    def expr(self, depth: int) -> Node:
        atom = self.atom(depth)
        if self.at("punct") and self.tok.text in "?*+":
            op = self.take("punct").text
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[op]
            self.b.repeat(max(lo, hi or 0))
            return Rep(atom, lo, hi)
        if self.at("punct", "~"):
            self.k += 1
            lo = int(self.take("number").text)
            hi = lo
            if self.at("dots"):
                self.k += 1
                hi = int(self.take("number").text)
            if hi < lo:
                raise self.fail(f"the repetition '~ {lo}..{hi}' has its bounds reversed")
            self.b.repeat(hi)
            return Rep(atom, lo, hi)
        return atom

    def atom(self, depth: int) -> Node:
        tok = self.tok
        if self.at("punct", "("):
            self.k += 1
            inner = self.expansions(depth + 1)
            self.skip_newlines()
            self.take("punct", ")")
            return inner
        if self.at("punct", "["):
            self.k += 1
            inner = self.expansions(depth + 1)
            self.skip_newlines()
            self.take("punct", "]")
            self.b.repeat(1)
            return Rep(inner, 0, 1)
        if tok.kind == "string":
            self.k += 1
            if tok.text.endswith("i"):
                raise self.fail("case-insensitive literals ('\"...\"i') are not supported", tok)
            text = _unquote(tok, self.b)
            if self.at("dots"):
                self.k += 1
                end_tok = self.take("string")
                end = _unquote(end_tok, self.b)
                if len(text) != 1 or len(end) != 1 or ord(end) < ord(text):
                    raise self.fail('a range \'"a".."z"\' needs two single characters, in order', tok)
                return Chars(normalised([(ord(text), ord(end))]))
            return Lit(text)
        if tok.kind == "regex":
            self.k += 1
            return self.regex(tok)
        if tok.kind == "name":
            self.k += 1
            if tok.text[0] in "?!":
                raise self.fail(f"the modifier in {tok.text!r} belongs before a definition", tok)
            if self.at("punct", "{"):
                raise self.fail("templates ('name{...}') are not supported", tok)
            self.refs.setdefault(tok.text, tok.at)
            return Ref(tok.text)
        what = "the end of a line" if tok.kind == "nl" else repr(tok.text)
        raise self.fail(f"expected a rule, terminal, literal or group, got {what}")

    def regex(self, tok: _Tok) -> Node:
        end = tok.text.rindex("/")
        flags = tok.text[end + 1 :]
        for f in flags:
            if f not in "sm":
                name = {"i": "case-insensitive matching", "x": "verbose"}.get(f, f"'{f}'")
                raise self.fail(f"the regex flag '{f}' ({name}) is not supported", tok)
        body = tok.text[1:end].replace("\\/", "/")
        return read_regex(body, self.b, offset=tok.at + 1, anchors=False, dotall="s" in flags)

    def resolve_imports(self) -> None:
        """Each imported terminal as a rule under its local name, referring to Lark's definition
        under a name no grammar can spell (`common.NAME`), so a grammar's own `DIGIT` does not
        change what an imported `INT` means."""
        for alias, name in self.imports.items():
            self.rules[alias] = Ref(f"common.{name}")
        pending = list(dict.fromkeys(self.imports.values()))
        done: set[str] = set()
        while pending:
            name = pending.pop()
            if name in done:
                continue
            done.add(name)
            sub = _Lark(f"{name}: {COMMON[name]}\n", self.b)
            sub.parse_definitions()
            self.rules[f"common.{name}"] = _renamed(sub.rules[name], lambda n: f"common.{n}")
            pending.extend(sub.refs)

    def parse_definitions(self) -> None:
        while True:
            self.skip_newlines()
            if self.at("end"):
                return
            self.definition()


def _renamed(node: Node, rename: Callable[[str], str]) -> Node:
    if isinstance(node, Ref):
        return Ref(rename(node.name))
    if isinstance(node, Seq):
        return Seq(tuple(_renamed(n, rename) for n in node.items))
    if isinstance(node, Alt):
        return Alt(tuple(_renamed(n, rename) for n in node.items))
    if isinstance(node, Rep):
        return Rep(_renamed(node.item, rename), node.lo, node.hi)
    return node


def read_lark(text: str, budget: Budget) -> TextGrammar:
    return _Lark(text, budget).parse()

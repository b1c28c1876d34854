"""A custom tool's input grammar — the Responses API's `format: {"type": "grammar", "syntax",
"definition"}` — read into a small tree that the engine writes as GBNF. Pure.

Two syntaxes, as OpenAI defines them: `regex` (the whole input matches the expression) and `lark`
(a Lark grammar; the input is a sentence of its `start` rule). Regular expressions mean what they
mean to Python's `re`, which Lark uses too: `\\d`, `\\w`, `\\s` are its Unicode classes, `.` is any
character but a newline (any at all under Lark's `s` flag). A Lark grammar is read as the
context-free language over characters it denotes: a terminal is the language of its literal or
expression, and no lexer chooses between terminals (so a grammar whose lexer would refuse a text
that the rules admit admits it here).

Read exactly: literals and escapes (`\\n`, `\\t`, `\\xHH`, `\\uHHHH`, `\\UHHHHHHHH`, `\\0`, escaped
punctuation), classes (ranges, negation, `\\d \\D \\w \\W \\s \\S` inside and out), `.`, groups
(capturing, `(?:...)`, `(?P<name>...)`), alternation, the quantifiers `* + ? {n} {n,} {n,m}` and
their lazy forms (laziness does not change what matches), and `^` / `$` at the very start / end of
a `regex` (the whole input matches anyway). Lark: rules and terminals (priorities and `?`, `!`, `_`
modifiers, which shape trees, not the language), alternatives over several lines, `-> alias`,
`"literal"`, `"a".."z"`, `/regex/` with the `s` (and no-op `m`) flag, `( )`, `[ ]`, `? * +`,
`~ n`, `~ n..m`, and `%import common.NAME` / `%import common (A, B)` for the terminals of Lark's
`common` module listed in `COMMON`.

Refused with a 400 that names the feature, where it is and the field (`param`): lookaround,
backreferences, word boundaries and other anchors, inline flags, possessive quantifiers, case-
insensitive matching, `\\N{...}` and unknown escapes; Lark's `%ignore` (text skipped between
tokens), `%declare`, `%override`, `%extend`, templates, other modules, an undefined or twice-defined
name, a missing `start` rule; a rule that can begin with itself (left recursion, which llama.cpp's
grammars cannot express) and a repetition without bound of something that can be empty (the same,
once written as GBNF).

Bounds, each a precise 400: the definition's length, the nodes of the tree, group nesting, rules,
each repetition's bound (llama.cpp expands `x{m,n}` into n rules), and the grammar's `width`: how
many ways through it a text can keep open at once, which is what llama.cpp's work per generated
character grows with (quadratically: it dedups its stacks pairwise).
"""

from __future__ import annotations

import re

from engine_pool.errors import BadRequest

from .lark import COMMON, read_lark
from .recursion import check_recursion
from .regex import read_regex
from .tree import (
    MAX_DEFINITION_CHARS,
    Alt,
    Budget,
    Chars,
    Lit,
    Node,
    Ranges,
    Ref,
    Rep,
    Seq,
    TextGrammar,
    complement,
)
from .width import MAX_WIDTH, check_width

__all__ = [
    "COMMON",
    "MAX_WIDTH",
    "SYNTAXES",
    "Alt",
    "Chars",
    "Lit",
    "Node",
    "Ranges",
    "Ref",
    "Rep",
    "Seq",
    "TextGrammar",
    "complement",
    "parse_grammar",
]

SYNTAXES = ("lark", "regex")
_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_grammar(syntax: str, definition: str, where: str) -> TextGrammar:
    """The grammar a custom tool's `format` defines, or BadRequest (param `where`, the definition's
    field) naming what is wrong or not supported, after bounded work."""
    budget = Budget(where)
    if len(definition) > MAX_DEFINITION_CHARS:
        raise budget.limit(
            f"the definition has {len(definition)} characters; at most {MAX_DEFINITION_CHARS} are accepted",
            MAX_DEFINITION_CHARS,
        )
    surrogate = _SURROGATE.search(definition)
    if surrogate is not None:
        raise budget.fail(f"a lone UTF-16 surrogate at offset {surrogate.start()} is not a character")
    if syntax == "regex":
        g = TextGrammar("regex", {"start": read_regex(definition, budget)}, "start")
    elif syntax == "lark":
        g = read_lark(definition, budget)
    else:
        raise BadRequest(f"unknown grammar syntax {syntax!r} ({', '.join(SYNTAXES)})", param=where)
    check_recursion(g, budget)
    check_width(g, budget)
    return g

"""`regex` grammars read as Python's `re` reads them: for every expression of a corpus, the read tree
admits exactly the texts `re.fullmatch` does; and what the reader cannot enforce is a precise 400."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_pool.errors import BadRequest
from engine_pool.protocol.tool_grammar import parse_grammar

from .conftest import admits

WHERE = "tools[2].format.definition"
EXPRESSIONS = [
    r"abc",
    r"a|b|",
    r"^(foo|bar)+$",
    r"\d{2,3}-[a-c]+",
    r"[^a-c\n]{0,3}x",
    r"[]a-]*",
    r"[\w.]+@\w+",
    r"\s*\S+",
    r"x{,2}y{2,}z{1}",
    r"(?:ab)*?c??",
    r"(?P<n>a|bc)\.\x41\u00e9\t",
    r"a{x}|{",
    r"[\^\]\\-]+",
    r"\0\012",
    r".\W",
]
ALPHABET = st.sampled_from(list("abcxyz-_.@\n\t {}!^]\\0123Aé٣"))


@pytest.mark.parametrize("expr", EXPRESSIONS)
@settings(max_examples=300, deadline=None)
@given(text=st.text(ALPHABET, max_size=8))
def test_the_read_tree_admits_what_re_fullmatch_does(expr: str, text: str) -> None:
    g = parse_grammar("regex", expr, WHERE)
    assert admits(g, text) == bool(re.fullmatch(expr, text)), (expr, text)


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        (r"a(?=b)", "'(?=' (lookahead) is not supported at offset 1"),
        (r"(?<!a)b", "'(?<!' (lookbehind) is not supported"),
        (r"(a)\1", "backreferences ('\\1') are not supported at offset 3"),
        (r"\bword", "the anchor '\\b' is not supported at offset 0"),
        (r"a^b", "the anchor '^' is supported only at the very start"),
        (r"a$|(b$)", "the anchor '$' is supported only"),
        (r"(?i)abc", "'(?i' (inline flags) is not supported"),
        (r"a*+", "possessive quantifiers"),
        (r"\N{BULLET}", "named characters"),
        (r"\q", "bad escape '\\q'"),
        (r"[[:alpha:]]", "a nested set or a set operation"),
        (r"[--a]", "a nested set or a set operation"),
        (r"[z-a]", "the range 'z-a' is reversed"),
        (r"(ab", "a group opened here is not closed at offset 0"),
        (r"ab)", "unbalanced ')'"),
        (r"*a", "nothing to repeat before '*'"),
        (r"a{3,1}", "has its bounds reversed"),
        (r"a**", "multiple repeat"),
        (r"(a*)*", "repeats without bound something that can be empty"),
        (r"(a|)+", "repeats without bound something that can be empty"),
        (r"a{1001}", "a repetition bound of 1001 exceeds 1000"),
        ("(" * 60 + "a" + ")" * 60, "groups nest deeper than 48"),
        (r"\ud800", "'\\ud800' is not a character"),
        ("a\ud800", "a lone UTF-16 surrogate at offset 1"),
        ("x" * 40000, "the definition has 40000 characters; at most 32768"),
        (r"[\w\W]{1,1000}" * 3, "more than 1024 ways through it open at once"),
        (r"(a{1,100}){1,100}", "more than 1024 ways"),
        ("|".join(f"w{i}" for i in range(2100)), "more than 1024 ways"),
    ],
)
def test_what_cannot_be_enforced_is_a_400_naming_it(expr: str, message: str) -> None:
    with pytest.raises(BadRequest) as exc:
        parse_grammar("regex", expr, WHERE)
    assert exc.value.status == 400 and exc.value.param == WHERE
    assert message in exc.value.message, exc.value.message
    assert exc.value.message.startswith(f"'{WHERE}': ")


def test_hostile_expressions_cost_bounded_work() -> None:
    """Reading is linear: the largest expression the limits admit reads fast, and a huge class or
    a deep alternation is refused by a limit, not by Python's recursion."""
    parse_grammar("regex", "[a-z]" * 6000, WHERE)
    with pytest.raises(BadRequest, match="more than 20000 parts"):
        parse_grammar("regex", "ab|" * 10900, WHERE)
    with pytest.raises(BadRequest, match="nest deeper"):
        parse_grammar("regex", "(?:" * 10000, WHERE)

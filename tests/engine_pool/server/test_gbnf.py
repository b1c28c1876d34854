"""engine_pool/server/gbnf.py: only real groups nest; literals, classes, tokens and comments do not."""

from __future__ import annotations

import pytest

from engine_pool.errors import BadRequest
from engine_pool.server.gbnf import check_grammar, group_depth


@pytest.mark.parametrize(
    ("grammar", "depth"),
    [
        ('root ::= "a"', 0),
        ('root ::= ("a" | ("b" ("c")))', 3),
        ('root ::= ("a") ("b") ("c")', 1),
        ('root ::= "((((" "\\"((" ")"', 0),  # escaped quotes stay inside the literal
        ("root ::= [(((] [^)(] [\\](]", 0),  # an escaped `]` does not end the class
        ("root ::= <(((> !<((>", 0),  # token references
        ("# ((((( a comment\nroot ::= (x)\n", 1),
        ("root ::= (((", 3),  # unbalanced: llama.cpp reports it; the depth is still bounded
        ("root ::= )))(", 1),
        ('root ::= "unterminated ((((', 0),
    ],
)
def test_group_depth(grammar: str, depth: int) -> None:
    assert group_depth(grammar) == depth


def test_the_scan_stops_past_the_limit() -> None:
    assert group_depth("(" * 50_000, stop_above=64) == 65


def test_limits_are_refused_with_the_field_and_the_limit() -> None:
    check_grammar("root ::= " + "(" * 64 + '"a"' + ")" * 64, 1 << 20, 64)
    with pytest.raises(BadRequest) as exc:
        check_grammar("root ::= " + "(" * 65 + '"a"' + ")" * 65, 1 << 20, 64)
    assert exc.value.message == (
        "'grammar' nests parenthesised groups more than 64 deep; this engine accepts at most 64 levels"
    )
    assert exc.value.extra == {"limit": 64} and exc.value.param == "grammar"
    with pytest.raises(BadRequest) as exc:
        check_grammar('root ::= "' + "é" * 600 + '"', 1024, 64)  # 1211 bytes in 611 characters
    assert exc.value.message == "'grammar' has 1211 bytes; this engine accepts grammars of at most 1024 bytes"
    check_grammar('root ::= "' + "é" * 500 + '"', 1024, 64)

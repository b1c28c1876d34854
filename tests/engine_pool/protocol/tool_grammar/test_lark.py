"""`lark` grammars read as the context-free language over characters they denote: the read tree
admits exactly the texts Lark's own Earley parser does when no lexer chooses between terminals
(`lexer="dynamic_complete"`); and what the reader cannot enforce is a precise 400."""

from __future__ import annotations

import random

import lark
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_pool.errors import BadRequest
from engine_pool.protocol.tool_grammar import COMMON, parse_grammar

from .conftest import TooDeep, admits, sentence

WHERE = "tools[0].format.definition"
# Codex's apply_patch tool, as OpenAI publishes it for custom tools.
APPLY_PATCH = r"""
start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
"""
PATCHES = [
    "*** Begin Patch\n*** Add File: a.py\n+x = 1\n+\n*** End Patch\n",
    "*** Begin Patch\n*** Delete File: b\n*** Update File: c\n@@ def f\n-a\n+b\n \n*** End Patch",
    "*** Begin Patch\n*** Update File: c\n*** Move to: d\n*** End Patch\n",
    "*** Begin Patch\n*** End Patch\n",  # no hunk
    "*** Begin Patch\n*** Add File: a.py\n*** End Patch\n",  # no line
    "*** Begin Patch\n*** Update File: c\n x\n*** End of File\n*** End Patch\n",
    "*** Begin Patch\n*** Delete File: \n*** End Patch\n",  # empty file name
]
ARITHMETIC = r"""
?start: sum
?sum: product (("+" | "-") product)*
?product: atom (("*" | "/") atom)*
?atom: NUMBER | "-" atom | "(" sum ")"
%import common.NUMBER
"""
SHAPES = r"""
start: item~2..3 [","] tail
item: "a".."c" | DIGIT -> digit
    | "x" "y"?
tail: WORD+ | CNAME
%import common (DIGIT, WORD, CNAME)
"""
REGEXES = r"""
start: KEY "=" VALUE
KEY.2: /[a-z_]\w*/
VALUE: /"([^"\\\n]|\\.)*"/ | /\d+(\.\d+)?/ | /x.y/s
"""
CASES = {
    "apply_patch": (APPLY_PATCH, "*** BeginPachFdlUpte:Mov@ EnofAdx.p+-\n"),
    "arithmetic": (ARITHMETIC, "0123.e+-*/()"),
    "shapes": (SHAPES, "abcxy019_,Z"),
    "regexes": (REGEXES, 'ab_9="\\\nx.y1'),
}


def _lark_admits(source: str, text: str) -> bool:
    parser = _parser(source)
    try:
        parser.parse(text)
    except lark.exceptions.LarkError:
        return False
    return True


_PARSERS: dict[str, lark.Lark] = {}


def _parser(source: str) -> lark.Lark:
    """Lark's Earley parser; a terminal that may be empty (`/(.*)/`), which its dynamic lexer
    refuses, written as the same language it takes (`[/(.+)/]`)."""
    if source not in _PARSERS:
        same = source.replace("/(.*)/", "[/(.+)/]")
        _PARSERS[source] = lark.Lark(same, parser="earley", lexer="dynamic_complete")
    return _PARSERS[source]


@pytest.mark.parametrize("text", PATCHES)
def test_apply_patch_samples_agree_with_lark(text: str) -> None:
    g = parse_grammar("lark", APPLY_PATCH, WHERE)
    assert admits(g, text) == _lark_admits(APPLY_PATCH, text)


@pytest.mark.parametrize("name", CASES)
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_the_read_tree_admits_what_lark_parses(name: str, data: st.DataObject) -> None:
    source, alphabet = CASES[name]
    text = data.draw(st.text(st.sampled_from(list(alphabet)), max_size=10))
    g = parse_grammar("lark", source, WHERE)
    assert admits(g, text) == _lark_admits(source, text), (name, text)


@pytest.mark.parametrize("name", CASES)
def test_sentences_of_the_read_tree_and_their_mutations_agree_with_lark(name: str) -> None:
    """Sentences drawn from the read tree parse with Lark; each with one character changed,
    dropped or doubled is admitted by both or by neither."""
    source, alphabet = CASES[name]
    g = parse_grammar("lark", source, WHERE)
    rnd = random.Random(name)
    drawn = 0
    while drawn < 40:
        try:
            text = sentence(g, rnd)
        except TooDeep:
            continue
        drawn += 1
        assert _lark_admits(source, text), (name, text)
        i = rnd.randrange(len(text)) if text else 0
        for mutated in (
            text[:i] + rnd.choice(alphabet) + text[i + 1 :],
            text[:i] + text[i + 1 :],
            text[:i] + text[i : i + 1] * 2 + text[i + 1 :],
        ):
            assert admits(g, mutated) == _lark_admits(source, mutated), (name, mutated)


def test_common_terminals_are_lark_s_own() -> None:
    """Each imported terminal admits what Lark's `common` module does on a corpus of words."""
    words = "0 12 -3 +4 1.5 .5 1e9 2.E-3 abc _x1 Ab".split() + ["x y", "\t ", "\r\n", "\n", "", "# c"]
    words += ['"q\\"s"', '"a\nb"', "// c", "-- c"]
    for name in (n for n in COMMON if not n.startswith("_")):
        source = f"start: {name}\n%import common.{name}\n"
        g = parse_grammar("lark", source, WHERE)
        for word in words:
            assert admits(g, word) == _lark_admits(source, word), (name, word)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("start: x\nx: start 'a'", 'unexpected "\'"'),
        ('start: start "a" | "b"', "the rule 'start' is left-recursive"),
        ('start: a\na: b? c\nb: "x"?\nc: a "y"', "the rule 'a' is left-recursive"),
        (
            'start: "a"*\n%ignore " "',
            "the directive '%ignore' (text skipped between tokens) is not supported",
        ),
        ('start: "a"\n%declare X', "the directive '%declare'"),
        ('start: "a"i', "case-insensitive literals"),
        ("start: /a/i", "the regex flag 'i' (case-insensitive matching)"),
        ("start: /a(?=b)/", "'(?=' (lookahead) is not supported at offset 9"),
        ("start: /^a/", "the anchor '^' is supported only"),
        ('start: "a"\n%import python.NAME', "only Lark's 'common' module"),
        ("start: X\n%import common.C_COMMENT", "'common.C_COMMENT' is not among the terminals"),
        ('start: a{"x"}', "templates"),
        ('start: "a"\nstart: "b"', "'start' is defined twice"),
        ('begin: "a"', "a Lark grammar needs a 'start' rule"),
        ("start: a", "'a' is used at offset 7 but never defined"),
        ('start: "a" ~ 3..1', "has its bounds reversed"),
        ('start: "ab".."c"', "two single characters"),
        ('start: ("a"?)+', "repeats without bound something that can be empty"),
        ('start: "a"~1001', "a repetition bound of 1001 exceeds 1000"),
        ('start: r~50\nr: s~1..50\ns: "a"', "more than 1024 ways"),
        ("start: " + "(" * 60 + '"a"' + ")" * 60, "groups nest deeper than 48"),
        (
            "start: "
            + " | ".join(f"r{i}" for i in range(1001))
            + "\n"
            + "\n".join(f'r{i}: "x"' for i in range(1001)),
            "more than 1000 rules",
        ),  # fmt: skip
        ('start: "a" @', "unexpected '@' at offset 11"),
        ('start: ("a"', "expected ')', got the end"),
    ],
)
def test_what_cannot_be_enforced_is_a_400_naming_it(source: str, message: str) -> None:
    with pytest.raises(BadRequest) as exc:
        parse_grammar("lark", source, WHERE)
    assert exc.value.status == 400 and exc.value.param == WHERE
    assert message in exc.value.message, exc.value.message

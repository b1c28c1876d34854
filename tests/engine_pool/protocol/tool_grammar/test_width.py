"""engine_pool/protocol/tool_grammar/width.py: how many ways through a grammar a text can keep open
at once — the figure llama.cpp's work per generated character grows with — is small for the
grammars people write and bounds the ones that would slow an engine, after bounded work."""

from __future__ import annotations

import pytest

from engine_pool.errors import BadRequest
from engine_pool.protocol.tool_grammar import MAX_WIDTH, parse_grammar
from engine_pool.protocol.tool_grammar.width import width

from .test_lark import APPLY_PATCH


@pytest.mark.parametrize(
    ("syntax", "definition", "most"),
    [
        ("regex", r"\d{3}-\d{3}-\d{4}", 2),
        ("regex", "[a-z]" * 500, 1),  # a long row of fixed parts: one way
        ("regex", r"[^\n]*\n[^\n]*\n", 8),  # unbounded loops: one copy each
        ("regex", r"[\w.]{1,64}@[\w-]{1,253}\.[a-z]{2,63}", 400),
        ("regex", "|".join(f"w{i}x" for i in range(100)), 100),  # alternatives sharing a start
        ("lark", APPLY_PATCH, 200),
        ("lark", 'start: "(" start ")" | "x"', 4),  # recursion nests stacks, it does not widen them
    ],
)
def test_what_people_write_is_narrow(syntax: str, definition: str, most: int) -> None:
    assert width(parse_grammar(syntax, definition, "d")) <= most


def test_overlapping_bounded_runs_widen_with_their_number() -> None:
    widths = [width(parse_grammar("regex", r"[\w\W]{1,100}" * n, "d")) for n in (1, 2, 4, 8)]
    assert widths[0] == 1 and widths == sorted(widths) and widths[-1] > 500


WIDE = "ways through it open at once"


@pytest.mark.parametrize(
    ("definition", "message"),
    [
        (r"[\w\W]{1,1000}" * 3, WIDE),
        (r"(a{1,100}){1,100}", WIDE),
        (r"(a|ab|abc){1,1000}", WIDE),
        ("|".join(f"w{i}" for i in range(MAX_WIDTH + 10)), WIDE),
        # Distinct repetitions, each weighed anew: the measuring itself is bounded.
        ("".join(f"(ab?){{1,{i}}}" for i in range(1, 1000))[:32000], "parts to weigh"),
    ],
)
def test_wide_or_costly_grammars_are_refused(definition: str, message: str) -> None:
    with pytest.raises(BadRequest) as exc:
        parse_grammar("regex", definition, "d")
    assert exc.value.status == 400 and exc.value.param == "d" and exc.value.extra["limit"]
    assert message in exc.value.message

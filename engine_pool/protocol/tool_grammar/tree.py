"""The tree a custom tool's input grammar is read into, its character sets, and the budget that
bounds reading it. Pure."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine_pool.errors import BadRequest

MAX_DEFINITION_CHARS = 32768
MAX_NODES = 20000
MAX_NESTING = 48
MAX_RULES = 1000
MAX_REPEAT = 1000  # one repetition's bound (llama.cpp: MAX_REPETITION_THRESHOLD 2000 per rule)

MAX_CHAR = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)  # never characters of a text: no class holds them

Ranges = tuple[tuple[int, int], ...]


# -- the tree -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Lit:
    text: str


@dataclass(frozen=True)
class Chars:
    """One character of a set: sorted, disjoint, inclusive code point ranges (no surrogates)."""

    ranges: Ranges


@dataclass(frozen=True)
class Seq:
    items: tuple[Node, ...]


@dataclass(frozen=True)
class Alt:
    items: tuple[Node, ...]


@dataclass(frozen=True)
class Rep:
    item: Node
    lo: int
    hi: int | None  # None: no upper bound


@dataclass(frozen=True)
class Ref:
    name: str


Node = Lit | Chars | Seq | Alt | Rep | Ref


@dataclass(frozen=True)
class TextGrammar:
    """The input's language: `rules[start]`, whose references name other rules (a regex: one rule)."""

    syntax: str
    rules: dict[str, Node]
    start: str


EMPTY = Seq(())


# -- character sets -----------------------------------------------------------------------------
def normalised(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """`ranges` sorted, merged and without surrogates."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        for a, b in ((lo, min(hi, SURROGATES[0] - 1)), (max(lo, SURROGATES[1] + 1), hi)):
            if a > b:
                continue
            if out and a <= out[-1][1] + 1:
                out[-1] = (out[-1][0], max(out[-1][1], b))
            else:
                out.append((a, b))
    return tuple(out)


def complement(ranges: Ranges) -> Ranges:
    """Every character not in `ranges` (normalised)."""
    out, at = [], 0
    for lo, hi in ranges:
        if lo > at:
            out.append((at, lo - 1))
        at = hi + 1
    if at <= MAX_CHAR:
        out.append((at, MAX_CHAR))
    return normalised(out)


def _scan(test: Callable[[str], bool]) -> Ranges:
    out: list[tuple[int, int]] = []
    start = None
    for cp in range(MAX_CHAR + 2):
        inside = cp <= MAX_CHAR and not (SURROGATES[0] <= cp <= SURROGATES[1]) and test(chr(cp))
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            out.append((start, cp - 1))
            start = None
    return normalised(out)


@functools.cache
def category(letter: str) -> Ranges:
    """`\\d`, `\\w` or `\\s` as Python's `re` reads them in a str pattern (Py_UNICODE_ISDECIMAL,
    ISALNUM or `_`, ISSPACE). Scanned once per process (a fraction of a second)."""
    tests: dict[str, Callable[[str], bool]] = {
        "d": str.isdecimal,
        "w": lambda c: c.isalnum() or c == "_",
        "s": str.isspace,
    }
    return _scan(tests[letter])


def shorthand(letter: str) -> Ranges:
    ranges = category(letter.lower())
    return complement(ranges) if letter.isupper() else ranges


ANY_BUT_NEWLINE = complement(((10, 10),))
ANY = normalised([(0, MAX_CHAR)])


# -- budget -------------------------------------------------------------------------------------
class Budget:
    """What one definition may cost, refused precisely the moment it is exceeded."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.nodes = 0

    def fail(self, what: str) -> BadRequest:
        return BadRequest(f"'{self.where}': {what}", param=self.where)

    def node(self) -> None:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise self.limit(f"the grammar has more than {MAX_NODES} parts", MAX_NODES)

    def repeat(self, bound: int) -> None:
        if bound > MAX_REPEAT:
            raise self.limit(f"a repetition bound of {bound} exceeds {MAX_REPEAT}", MAX_REPEAT)

    def limit(self, what: str, limit: int) -> BadRequest:
        return BadRequest(
            f"'{self.where}': {what}, the limit of this server", param=self.where, extra={"limit": limit}
        )


def seq(items: list[Node]) -> Node:
    return items[0] if len(items) == 1 else Seq(tuple(items))


def alt(items: list[Node]) -> Node:
    return items[0] if len(items) == 1 else Alt(tuple(items))

"""How many places in a grammar a text can be at once: a bound on the work llama.cpp does per
generated character. Pure.

llama.cpp follows every way through a grammar at once (one stack per way), dedups them pairwise
and tests every candidate token against them: a grammar that keeps thousands of ways open — eight
overlapping `[\\w\\W]{1,1000}` in a row, three thousand alternatives with one prefix, a repetition
inside a repetition — costs tens of milliseconds per token on the engine's one decode thread,
slowing every slot. `width` over-approximates the ways, from each part's positions and the spread
of the lengths it matches: in a row, a part can be entered at as many offsets as the parts before
it spread over (`[a-z]{1,9}[0-9]` keeps few ways open, eight `[\\w\\W]{1,256}` in a row many); an
alternation sums its alternatives' ways; a bounded repetition is its copies in a row, an unbounded
one a loop (one copy); a rule is what its body is, and a reference back into the rules being
measured (recursion) one place of unknown length. Which characters each part takes is not looked
at: `[^,]{0,999},[^,]{0,999}` counts as if its fields could overlap (an unbounded `[^,]*` is cheap).
"""

from __future__ import annotations

from dataclasses import dataclass

from .tree import Alt, Budget, Lit, Node, Ref, Rep, Seq, TextGrammar

MAX_WIDTH = 1024


def _refs(node: Node, out: set[str]) -> None:
    if isinstance(node, Ref):
        out.add(node.name)
    elif isinstance(node, Seq | Alt):
        for item in node.items:
            _refs(item, out)
    elif isinstance(node, Rep):
        _refs(node.item, out)


def _components(g: TextGrammar) -> list[list[str]]:
    """The strongly connected components of the rules' reference graph, each after every one it
    refers to (Tarjan's algorithm, iterative: a chain of a thousand rules is no Python recursion)."""
    edges = {}
    for name, node in g.rules.items():
        found: set[str] = set()
        _refs(node, found)
        edges[name] = sorted(found)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for root in g.rules:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            name, i = work.pop()
            if i == 0:
                index[name] = low[name] = len(index)
                stack.append(name)
                on_stack.add(name)
            if i < len(edges[name]):
                work.append((name, i + 1))
                nxt = edges[name][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[name] = min(low[name], index[nxt])
                continue
            for child in edges[name]:
                if child in on_stack:
                    low[name] = min(low[name], low[child])
            if low[name] == index[name]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == name:
                        break
                out.append(component)
    return out


@dataclass(frozen=True)
class _Shape:
    lo: int  # the shortest text it matches
    hi: int  # the longest (HUGE: no bound)
    places: int  # its positions: where a text can be in it
    ways: int  # places a text entered at one offset can be in at once

    @property
    def spread(self) -> int:
        return HUGE if self.hi >= HUGE else self.hi - self.lo


HUGE = 1 << 40
_ONE = _Shape(1, 1, 1, 1)
MAX_WORK = 200_000  # parts measured, over the whole grammar: a bound on the measuring itself


class TooComplex(Exception):
    pass


class _Measure:
    """Shapes of a grammar's parts, within `cap` ways and MAX_WORK parts of measuring."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.work = 0
        self.repeats: dict[tuple[_Shape, int, int | None], _Shape] = {}

    def row(self, parts: list[tuple[int, int, _Shape]]) -> int:
        """The most ways open at once among `parts` ((first offset, last offset, shape): where each
        can be entered): a part entered at n offsets has up to n times its ways open (never more
        than its places), over the prefix lengths from its first entry to its last exit."""
        self.work += len(parts)
        if self.work > MAX_WORK:
            raise TooComplex
        events: list[tuple[int, int]] = []
        for first, last, shape in parts:
            ways = min(shape.places, min(self.cap, 1 + last - first) * shape.ways)
            events += [(first, ways), (min(HUGE, last + shape.hi), -ways)]
        most = now = 0
        # A part is open from its first entry until its last exit, exclusive: at the offset where
        # one part ends and the next begins, the text is at the next one's start only.
        for _, delta in sorted(events):
            now += delta
            most = max(most, now)
        return min(self.cap, most)

    def sequence(self, items: list[_Shape]) -> _Shape:
        first = last = 0
        parts = []
        for item in items:
            parts.append((first, last, item))
            first, last = min(HUGE, first + item.lo), min(HUGE, last + item.hi)
        return _Shape(first, last, min(self.cap, sum(i.places for i in items)), self.row(parts))

    def repeat(self, item: _Shape, lo: int, hi: int | None) -> _Shape:
        """Copy j (from 0) of a bounded repetition is entered between j·lo and j·hi of the item's
        lengths (a copy past `lo` may be where it ends; copies past `cap` add nothing: each adds
        at least a way); an unbounded one is a loop: one copy's places, entered anywhere."""
        key = (item, lo, hi)
        if key not in self.repeats:
            if hi is None:
                ways = min(self.cap, item.places + 1)
                shape = _Shape(min(HUGE, lo * item.lo), HUGE, item.places + 1, ways)
            else:
                copies = range(min(hi, self.cap))
                parts = [(min(HUGE, j * item.lo), min(HUGE, j * item.hi), item) for j in copies]
                places = min(self.cap, hi * item.places)
                ways = self.row(parts) or 1
                shape = _Shape(min(HUGE, lo * item.lo), min(HUGE, hi * item.hi), places, ways)
            self.repeats[key] = shape
        return self.repeats[key]


def width(g: TextGrammar) -> int:
    """The over-approximated number of places a text can be in `g` at once (capped just past
    MAX_WIDTH: the exact figure of a refused grammar is of no use). Raises TooComplex past
    MAX_WORK parts measured."""
    m = _Measure(MAX_WIDTH + 1)
    known: dict[str, _Shape] = {}
    unknown = _Shape(0, HUGE, 1, 1)  # a reference back into the rules being measured

    def of(node: Node, same: set[str]) -> _Shape:
        if isinstance(node, Lit):
            return _Shape(len(node.text), len(node.text), max(1, len(node.text)), 1)
        if isinstance(node, Ref):
            return unknown if node.name in same else known[node.name]
        if isinstance(node, Seq):
            return m.sequence([of(item, same) for item in node.items])
        if isinstance(node, Alt):
            shapes = [of(item, same) for item in node.items]
            return _Shape(
                min(s.lo for s in shapes),
                max(s.hi for s in shapes),
                min(m.cap, sum(s.places for s in shapes)),
                min(m.cap, sum(s.ways for s in shapes)),
            )
        if isinstance(node, Rep):
            return m.repeat(of(node.item, same), node.lo, node.hi)
        return _ONE  # a class

    for component in _components(g):
        same = set(component)
        for name in component:
            known[name] = of(g.rules[name], same)
    return known[g.start].ways


def check_width(g: TextGrammar, budget: Budget) -> None:
    try:
        w = width(g)
    except TooComplex:
        raise budget.limit(
            f"the grammar has more than {MAX_WORK} repeated or sequenced parts to weigh", MAX_WORK
        ) from None
    if w > MAX_WIDTH:
        raise budget.limit(
            f"the grammar can keep more than {MAX_WIDTH} ways through it open at once (long bounded "
            "repetitions in a row or inside one another, or many alternatives), which would slow every "
            "generation on the engine; an unbounded repetition (* or +) costs one way",
            MAX_WIDTH,
        )

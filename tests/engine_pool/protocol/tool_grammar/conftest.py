"""A matcher of the tree engine_pool.protocol.tool_grammar reads: the oracle that says which texts
a read grammar admits, to hold against Python's `re` and Lark's own parser."""

from __future__ import annotations

import random
from functools import cache

from engine_pool.protocol.tool_grammar import Alt, Chars, Lit, Node, Ref, Rep, Seq, TextGrammar


def admits(g: TextGrammar, text: str) -> bool:
    """Whether `text` is a sentence of `g` (every way through the tree, memoised by position)."""

    @cache
    def ends(node: Node, i: int) -> frozenset[int]:
        if isinstance(node, Lit):
            return frozenset({i + len(node.text)}) if text.startswith(node.text, i) else frozenset()
        if isinstance(node, Chars):
            ok = i < len(text) and any(lo <= ord(text[i]) <= hi for lo, hi in node.ranges)
            return frozenset({i + 1}) if ok else frozenset()
        if isinstance(node, Ref):
            return ends(g.rules[node.name], i)
        if isinstance(node, Seq):
            at = frozenset({i})
            for item in node.items:
                at = frozenset(e for j in at for e in ends(item, j))
            return at
        if isinstance(node, Alt):
            return frozenset(e for item in node.items for e in ends(item, i))
        assert isinstance(node, Rep)
        out = {i} if node.lo == 0 else set()
        at, k = frozenset({i}), 0
        while at and (node.hi is None or k < node.hi):
            at = frozenset(e for j in at for e in ends(node.item, j))
            k += 1
            if k >= node.lo:
                if node.hi is None and at <= out:
                    break
                out |= at
        return frozenset(out)

    return len(text) in ends(g.rules[g.start], 0)


class TooDeep(Exception):
    pass


def sentence(g: TextGrammar, rnd: random.Random, max_depth: int = 40) -> str:
    """A random sentence of `g` (repetitions kept short, characters drawn from ASCII when a class
    has some); raises TooDeep when the draw recursed too far (draw again)."""

    def draw(node: Node, depth: int) -> str:
        if depth > max_depth:
            raise TooDeep
        if isinstance(node, Lit):
            return node.text
        if isinstance(node, Chars):
            ascii_ranges = [(lo, min(hi, 0x7E)) for lo, hi in node.ranges if lo <= 0x7E]
            lo, hi = rnd.choice(ascii_ranges or list(node.ranges))
            return chr(rnd.randint(lo, hi))
        if isinstance(node, Ref):
            return draw(g.rules[node.name], depth + 1)
        if isinstance(node, Seq):
            return "".join(draw(item, depth) for item in node.items)
        if isinstance(node, Alt):
            return draw(rnd.choice(node.items), depth + 1)
        assert isinstance(node, Rep)
        n = rnd.randint(node.lo, node.lo + 2 if node.hi is None else min(node.hi, node.lo + 2))
        return "".join(draw(node.item, depth + 1) for _ in range(n))

    return draw(g.rules[g.start], 0)

"""Regular expressions in Python's `re` syntax (the subset the package reads) as a tree. Pure."""

from __future__ import annotations

import re

from engine_pool.errors import BadRequest

from .tree import (
    ANY,
    ANY_BUT_NEWLINE,
    EMPTY,
    MAX_CHAR,
    MAX_NESTING,
    SURROGATES,
    Budget,
    Chars,
    Lit,
    Node,
    Ranges,
    Rep,
    alt,
    complement,
    normalised,
    seq,
    shorthand,
)

ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}
HEX = {"x": 2, "u": 4, "U": 8}
_QUANTIFIER = re.compile(r"\{(\d*)(,(\d*))?\}")


class _Regex:
    """A recursive-descent reader of one expression (Python `re` syntax, the subset above)."""

    def __init__(self, text: str, budget: Budget, *, offset: int = 0, anchors: bool, dotall: bool) -> None:
        self.s, self.i, self.b = text, 0, budget
        self.offset, self.anchors, self.dotall = offset, anchors, dotall

    def fail(self, what: str, at: int | None = None) -> BadRequest:
        return self.b.fail(f"{what} at offset {self.offset + (self.i if at is None else at)}")

    def parse(self) -> Node:
        node = self._alternatives(0, top=True)
        if self.i < len(self.s):  # only an unmatched ')' stops the top level early
            raise self.fail("unbalanced ')'")
        return node

    def _alternatives(self, depth: int, *, top: bool = False) -> Node:
        if depth > MAX_NESTING:
            raise self.b.limit(f"groups nest deeper than {MAX_NESTING}", MAX_NESTING)
        alts = [self._sequence(depth, top)]
        while self.i < len(self.s) and self.s[self.i] == "|":
            self.i += 1
            alts.append(self._sequence(depth, top))
        return alt(alts)

    def _sequence(self, depth: int, top: bool) -> Node:
        items: list[Node] = []
        start = self.i
        while self.i < len(self.s) and self.s[self.i] not in "|)":
            c = self.s[self.i]
            if c == "^" or c == "$":
                self._anchor(c, start, top)
                continue
            atom = self._atom(depth)
            items.append(self._quantified(atom))
            self.b.node()
        return seq(items) if items else EMPTY

    def _anchor(self, c: str, start: int, top: bool) -> None:
        """`^` first / `$` last in a top-level alternative of a `regex`: the whole input matches
        anyway. Anywhere else it constrains what comes around it: refused."""
        at = self.i
        self.i += 1
        end = self.i >= len(self.s) or self.s[self.i] == "|"
        if self.anchors and top and ((c == "^" and at == start) or (c == "$" and end)):
            return
        raise self.fail(f"the anchor '{c}' is supported only at the very start ('^') or end ('$')", at)

    def _atom(self, depth: int) -> Node:
        c = self.s[self.i]
        if c == "(":
            return self._group(depth)
        if c == "[":
            return Chars(self._class())
        if c == ".":
            self.i += 1
            return Chars(ANY if self.dotall else ANY_BUT_NEWLINE)
        if c == "\\":
            return self._escape_atom()
        if c in "*+?":
            raise self.fail(f"nothing to repeat before '{c}'")
        if c == "{" and _QUANTIFIER.match(self.s, self.i) and self._is_quantifier(self.i):
            raise self.fail("nothing to repeat before '{'")
        self.i += 1
        return Lit(c)

    def _is_quantifier(self, at: int) -> bool:
        m = _QUANTIFIER.match(self.s, at)
        return m is not None and bool(m.group(1) or m.group(3))

    def _group(self, depth: int) -> Node:
        open_at = self.i
        self.i += 1
        if self.s.startswith("?", self.i):
            if self.s.startswith("?:", self.i):
                self.i += 2
            elif self.s.startswith("?P<", self.i):
                end = self.s.find(">", self.i)
                if end < 0 or not self.s[self.i + 3 : end].isidentifier():
                    raise self.fail("a malformed group name")
                self.i = end + 1
            else:
                raise self.fail(_group_kind(self.s, self.i), open_at)
        inner = self._alternatives(depth + 1)
        if self.i >= len(self.s) or self.s[self.i] != ")":
            raise self.fail("a group opened here is not closed", open_at)
        self.i += 1
        return inner

    def _quantified(self, atom: Node) -> Node:
        if self.i >= len(self.s):
            return atom
        c = self.s[self.i]
        if c in "*+?":
            self.i += 1
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        elif c == "{" and self._is_quantifier(self.i):
            m = _QUANTIFIER.match(self.s, self.i)
            assert m is not None
            self.i = m.end()
            lo = int(m.group(1) or 0)
            hi = int(m.group(3)) if m.group(3) else (None if m.group(2) else lo)
            if hi is not None and hi < lo:
                raise self.fail(f"the repetition {{{lo},{hi}}} has its bounds reversed", m.start())
        else:
            return atom
        if self.i < len(self.s) and self.s[self.i] == "+":
            raise self.fail("possessive quantifiers ('*+', '++', '?+', '{m,n}+') are not supported")
        if self.i < len(self.s) and self.s[self.i] == "?":
            self.i += 1  # lazy: the same texts match
        if self.i < len(self.s) and (self.s[self.i] in "*+?" or self._is_quantifier(self.i)):
            raise self.fail("multiple repeat")
        self.b.repeat(max(lo, hi or 0))
        return Rep(atom, lo, hi)

    # escapes and classes
    def _escape_atom(self) -> Node:
        kind, value = self._escape(in_class=False)
        if kind == "set":
            assert isinstance(value, tuple)
            return Chars(value)
        assert isinstance(value, str)
        return Lit(value)

    def _escape(self, *, in_class: bool) -> tuple[str, str | Ranges]:
        """After a backslash: ("char", c) or ("set", ranges)."""
        at = self.i
        if self.i + 1 >= len(self.s):
            raise self.fail("a trailing backslash", at)
        c = self.s[self.i + 1]
        self.i += 2
        if c in "dDwWsS":
            return "set", shorthand(c)
        if c in ESCAPES:
            return "char", ESCAPES[c]
        if c == "b" and in_class:
            return "char", "\b"
        if c in HEX:
            digits = self.s[self.i : self.i + HEX[c]]
            if len(digits) != HEX[c] or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail(f"'\\{c}' needs {HEX[c]} hex digits", at)
            self.i += HEX[c]
            cp = int(digits, 16)
            if cp > MAX_CHAR or SURROGATES[0] <= cp <= SURROGATES[1]:
                raise self.fail(f"'\\{c}{digits}' is not a character", at)
            return "char", chr(cp)
        if c == "0":
            digits = "0"
            while len(digits) < 3 and self.i < len(self.s) and self.s[self.i] in "01234567":
                digits += self.s[self.i]
                self.i += 1
            return "char", chr(int(digits, 8))
        if c.isdigit():
            raise self.fail("backreferences ('\\1') are not supported", at)
        if c in "bBAZ":
            raise self.fail(f"the anchor '\\{c}' is not supported", at)
        if c == "N":
            raise self.fail("named characters ('\\N{...}') are not supported", at)
        if c.isascii() and c.isalnum():
            raise self.fail(f"bad escape '\\{c}'", at)
        return "char", c

    def _class(self) -> Ranges:
        open_at = self.i
        self.i += 1
        negated = self.s.startswith("^", self.i)
        if negated:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            if self.i >= len(self.s):
                raise self.fail("a character class opened here is not closed", open_at)
            c = self.s[self.i]
            if c == "]" and not first:
                self.i += 1
                break
            if self.s.startswith(("[", "--", "&&", "~~", "||"), self.i):
                raise self.fail(
                    f"'{self.s[self.i : self.i + 2]}' inside a class (a nested set or a set operation) "
                    "is not supported"
                )
            first = False
            lo = self._class_item()
            if isinstance(lo, tuple):
                ranges.extend(lo)
                continue
            if self.s.startswith("-", self.i) and not self.s.startswith("-]", self.i):
                dash = self.i
                self.i += 1
                hi = self._class_item()
                if isinstance(hi, tuple):
                    raise self.fail("a range cannot end with a class shorthand", dash)
                if ord(hi) < ord(lo):
                    raise self.fail(f"the range '{lo}-{hi}' is reversed", dash)
                ranges.append((ord(lo), ord(hi)))
            else:
                ranges.append((ord(lo), ord(lo)))
            self.b.node()
        out = normalised(ranges)
        out = complement(out) if negated else out
        if not out:
            raise self.fail("the class matches no character", open_at)
        return out

    def _class_item(self) -> str | Ranges:
        if self.s[self.i] == "\\":
            kind, value = self._escape(in_class=True)
            return value
        c = self.s[self.i]
        self.i += 1
        return c


def _group_kind(s: str, i: int) -> str:
    """What the `(?` group at `i` (its `?`) is, for its refusal."""
    rest = s[i + 1 : i + 4]
    kinds = (
        (("=", "!"), "lookahead"),
        (("<=", "<!"), "lookbehind"),
        (("P=",), "a backreference"),
        (("(",), "a conditional"),
        (("#",), "a comment group"),
        ((">",), "an atomic group"),
    )
    for prefixes, kind in kinds:
        for prefix in prefixes:
            if rest.startswith(prefix):
                return f"'(?{prefix}' ({kind}) is not supported"
    return f"'(?{rest[:1]}' (inline flags) is not supported"


def read_regex(
    text: str, budget: Budget, *, offset: int = 0, anchors: bool = True, dotall: bool = False
) -> Node:
    return _Regex(text, budget, offset=offset, anchors=anchors, dotall=dotall).parse()

"""A client's raw GBNF `grammar` (llama-server's field), bounded before llama.cpp parses it.

llama.cpp's grammar parser recurses once per parenthesised group (`parse_sequence` ->
`parse_alternates` -> `parse_sequence` ...) and runs on the thread that submits the request — the
event loop's — so 50,000 nested `(` overflow the C++ stack and kill the process with every session
on it. `check_grammar` refuses, in one linear pass, grammars longer than a byte limit or nesting
groups deeper than a depth limit. The scan knows GBNF's lexical rules so that only real groups
count: a `(` inside a string literal `"..."`, a character class `[...]`, a token `<...>` or a `#`
comment does not nest. Brackets never nest in GBNF (a class cannot hold a class), so parentheses
are the only nesting. Whether the grammar is otherwise valid is left to llama.cpp (a 400 as well).
"""

from __future__ import annotations

from engine_pool.errors import BadRequest


def group_depth(grammar: str, stop_above: int | None = None) -> int:
    """The deepest nesting of parenthesised groups, outside literals, classes, tokens and comments.

    Stops scanning once the depth passes `stop_above` (the answer is then `stop_above + 1`).
    Unbalanced or unterminated constructs are not errors here: llama.cpp reports them.
    """
    depth = deepest = 0
    i, n = 0, len(grammar)
    while i < n:
        c = grammar[i]
        if c == '"' or c == "[" or c == "<":
            i = _skip_span(grammar, i + 1, {'"': '"', "[": "]", "<": ">"}[c])
            continue
        if c == "#":
            j = grammar.find("\n", i)
            i = n if j < 0 else j + 1
            continue
        if c == "(":
            depth += 1
            if depth > deepest:
                deepest = depth
                if stop_above is not None and deepest > stop_above:
                    return deepest
        elif c == ")":
            depth = max(depth - 1, 0)
        i += 1
    return deepest


def _skip_span(text: str, i: int, close: str) -> int:
    """The index after the unescaped `close` that ends a span starting at `i` (or the end)."""
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2  # an escape: the next character is data (`\"`, `\]`, `\\`, `\x..`)
            continue
        if c == close:
            return i + 1
        i += 1
    return n


def check_grammar(grammar: str, max_bytes: int, max_depth: int, field: str = "grammar") -> None:
    """Refuse (400, naming the field and the limit) a raw grammar over the size or depth limit."""
    # Cheap first: a str has at most 4 bytes per character, and at least one.
    size = len(grammar) if len(grammar) * 4 <= max_bytes else len(grammar.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise BadRequest(
            f"'{field}' has {size} bytes; this engine accepts grammars of at most {max_bytes} bytes",
            param=field,
            extra={"limit": max_bytes},
        )
    depth = group_depth(grammar, stop_above=max_depth)
    if depth > max_depth:
        raise BadRequest(
            f"'{field}' nests parenthesised groups more than {max_depth} deep; "
            f"this engine accepts at most {max_depth} levels",
            param=field,
            extra={"limit": max_depth},
        )

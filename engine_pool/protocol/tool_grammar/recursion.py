"""What GBNF cannot express and a grammar here must not hold: left recursion, and a repetition
without bound of something that can be empty (GBNF writes it as a rule that begins with itself).
Pure."""

from __future__ import annotations

from collections.abc import Callable

from engine_pool.errors import BadRequest

from .tree import Alt, Budget, Chars, Lit, Node, Ref, Rep, Seq, TextGrammar


def _nullable(rules: dict[str, Node]) -> set[str]:
    """The rules that match the empty text (a fixed point)."""
    empty: set[str] = set()
    while True:
        more = {name for name, node in rules.items() if name not in empty and _empty(node, empty)}
        if not more:
            return empty
        empty |= more


def _empty(node: Node, empty_rules: set[str]) -> bool:
    if isinstance(node, Lit):
        return not node.text
    if isinstance(node, Chars):
        return False
    if isinstance(node, Seq):
        return all(_empty(n, empty_rules) for n in node.items)
    if isinstance(node, Alt):
        return any(_empty(n, empty_rules) for n in node.items)
    if isinstance(node, Rep):
        return node.lo == 0 or _empty(node.item, empty_rules)
    return node.name in empty_rules


def _leading(node: Node, empty_rules: set[str], out: set[str], fail: Callable[[str], BadRequest]) -> None:
    """The rules `node` can begin with (before any character); refuses a repetition without bound
    of something that can be empty (GBNF writes it as a rule that begins with itself)."""
    if isinstance(node, Ref):
        out.add(node.name)
    elif isinstance(node, Seq):
        for item in node.items:
            _leading(item, empty_rules, out, fail)
            if not _empty(item, empty_rules):
                break
    elif isinstance(node, Alt):
        for item in node.items:
            _leading(item, empty_rules, out, fail)
    elif isinstance(node, Rep):
        if node.hi is None and _empty(node.item, empty_rules):
            raise fail(
                "repeats without bound something that can be empty (write it so that each "
                "repetition matches at least one character)"
            )
        _leading(node.item, empty_rules, out, fail)
    # Lit, Chars: no rule


def check_recursion(g: TextGrammar, budget: Budget) -> None:
    """Refuse left recursion (a rule that can begin with itself, directly or through others, maybe
    after rules that match the empty text) and empty unbounded repetitions, naming the rule."""
    empty = _nullable(g.rules)
    leading: dict[str, list[str]] = {}
    for name, node in g.rules.items():
        out: set[str] = set()

        def fail(what: str, rule: str = name) -> BadRequest:
            return budget.fail(f"the rule {rule!r} {what}")

        _leading(node, empty, out, fail)
        leading[name] = sorted(out)
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    for root in g.rules:
        if state.get(root):
            continue
        state[root] = 1
        stack: list[tuple[str, list[str]]] = [(root, list(leading[root]))]
        while stack:
            name, todo = stack[-1]
            if not todo:
                state[name] = 2
                stack.pop()
                continue
            nxt = todo.pop()
            if state.get(nxt) == 1:
                raise budget.fail(
                    f"the rule {nxt!r} is left-recursive (it can begin with itself), which grammars here "
                    'cannot express: write it with repetition, e.g. `expr: term ("+" term)*`'
                )
            if not state.get(nxt):
                state[nxt] = 1
                stack.append((nxt, list(leading.get(nxt, ()))))

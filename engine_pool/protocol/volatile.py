"""Volatile blocks: text an agent changes on every request without changing its meaning, dropped or
moved to the end of the prompt before the conversation is rendered. Pure.

On a hybrid model nothing after a changed token can be reused, so one volatile line near the top
(Claude Code's `x-anthropic-billing-header: …; cch=<5 hex>;` block, whose nonce changes on every
request) costs the whole prompt on every turn. A `VolatileRule` names such text: a regular
expression matched against each line of a message's text, and what to do with the lines it
matches:

- `drop`: remove them (the built-in `claude-code-billing` rule: what llama.cpp, ollama, SGLang
  and most Anthropic-compatible proxies do with that block);
- `move_end`: remove them and append them to the last message, so that the model still reads them
  but everything before stays stable (the previous turn's last message then changes: a turn
  evaluates that message again, not the whole prompt).

`scope` says where: `system` (system and developer messages: where agents put such blocks) or
`all` (every message). A line is removed with its line break; a message whose text becomes empty is
dropped. The rules run on chat messages, after the Messages and Responses APIs are translated to
them (an Anthropic system block is a line of the system message there), so every API gets the same
treatment. A rule that would match every line (an empty line, or each of a few ordinary lines) is
refused when the rule is made: it would erase conversations, not volatile blocks.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Action = Literal["drop", "move_end"]
Scope = Literal["system", "all"]
ACTIONS: tuple[str, ...] = ("drop", "move_end")
SCOPES: tuple[str, ...] = ("system", "all")
MAX_PATTERN_CHARS = 1000
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
# Lines any conversation has: a rule matching all of them (or the empty line) matches everything.
_ORDINARY = ("Hello", "You are a helpful assistant.", "{", "x", "1")
_SYSTEM_ROLES = ("system", "developer")


class RuleError(ValueError):
    """A rule that cannot be used (the message says why)."""


@dataclass(frozen=True)
class VolatileRule:
    name: str
    pattern: re.Pattern[str]  # searched in each line (without its line break)
    action: Action = "drop"
    scope: Scope = "system"
    # Text every match contains (read off the pattern's start), or None: a message without it is
    # passed by without a regex pass over its lines (every request's system prompt is scanned).
    literal: str | None = None


_SPECIAL = ".^$*+?{}[]|()"
_OPTIONAL = "*?{"  # quantifiers that let the character before them be absent


def literal_prefix(pattern: str) -> str | None:
    """The literal text a match of `pattern` starts with (after a leading `^`), when it has at
    least 3 characters; None for patterns with alternatives, groups or flags first, or no literal."""
    if "|" in pattern or pattern.startswith("(?"):
        return None
    i = 1 if pattern.startswith("^") else 0
    out: list[str] = []
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            nxt = pattern[i + 1 : i + 2]
            if not nxt or nxt.isalnum():  # \s, \d, \b, \A, back-references: not literal text
                break
            out.append(nxt)
            i += 2
            continue
        if c in _SPECIAL:
            if c in _OPTIONAL and out:
                out.pop()
            break
        out.append(c)
        i += 1
    text = "".join(out)
    return text if len(text) >= 3 else None


def make_rule(name: Any, pattern: Any, action: Any = "drop", scope: Any = "system") -> VolatileRule:
    """A checked rule, or RuleError saying what is wrong."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise RuleError(f"rule name {name!r} must be 1..64 letters, digits or '_.-'")
    if not isinstance(pattern, str) or not pattern:
        raise RuleError(f"rule {name}: 'pattern' must be a non-empty string")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise RuleError(
            f"rule {name}: 'pattern' has {len(pattern)} characters; the limit is {MAX_PATTERN_CHARS}"
        )
    if action not in ACTIONS:
        raise RuleError(f"rule {name}: 'action' must be one of {', '.join(ACTIONS)}, got {action!r}")
    if scope not in SCOPES:
        raise RuleError(f"rule {name}: 'scope' must be one of {', '.join(SCOPES)}, got {scope!r}")
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise RuleError(f"rule {name}: 'pattern' is not a regular expression: {exc}") from None
    if compiled.search("") is not None or all(compiled.search(line) for line in _ORDINARY):
        raise RuleError(
            f"rule {name}: 'pattern' {pattern!r} matches every line; it would erase conversations"
        )
    return VolatileRule(name, compiled, action, scope, literal_prefix(pattern))  # type: ignore[arg-type]


# Claude Code (2.1.36 and later) sends `x-anthropic-billing-header: cc_version=…; cc_entrypoint=…;
# cch=<5 hex>;` as its first system block, with a new `cch` on every request.
BUILTIN_RULES: tuple[VolatileRule, ...] = (
    make_rule("claude-code-billing", r"^x-anthropic-billing-header:\s"),
)


def _candidate_lines(text: str, literal: str | None) -> Iterator[tuple[int, int, int]]:
    """(start, end, end with its line break) of each line that may match: every line, or with a
    literal only those that contain it (found by `str.find`, not by a regex pass over each line).
    A line ends at "\n"; a "\r" before it is no part of it."""
    if literal is None:
        start = 0
        while start < len(text):
            nl = text.find("\n", start)
            stop = len(text) if nl < 0 else nl
            yield start, stop, stop if nl < 0 else nl + 1
            start = stop if nl < 0 else nl + 1
        return
    at = text.find(literal)
    while at >= 0:
        start = text.rfind("\n", 0, at) + 1
        nl = text.find("\n", at)
        stop = len(text) if nl < 0 else nl
        yield start, stop, stop if nl < 0 else nl + 1
        at = -1 if nl < 0 else text.find(literal, nl + 1)


def _split(text: str, rule: VolatileRule) -> tuple[str, list[str]]:
    """`text` without the lines `rule` matches (each with its line break), and those lines."""
    kept: list[str] = []
    taken: list[str] = []
    resume = 0  # where the kept text goes on
    for start, stop, end in _candidate_lines(text, rule.literal):
        line = text[start:stop].removesuffix("\r")
        if rule.pattern.search(line):
            kept.append(text[resume:start])
            taken.append(line)
            resume = end
    if not taken:
        return text, []
    kept.append(text[resume:])
    return "".join(kept), taken


def _apply(message: dict[str, Any], rule: VolatileRule) -> tuple[dict[str, Any] | None, list[str]]:
    """The message with the rule applied (None: nothing left of it), the lines taken out."""
    content = message.get("content")
    if isinstance(content, str):
        text, taken = _split(content, rule)
        if not taken:
            return message, []
        return ({**message, "content": text} if text.strip() or message.get("tool_calls") else None), taken
    if not isinstance(content, list):
        return message, []
    parts, taken = [], []
    for part in content:
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            text, out = _split(part["text"], rule)
            taken += out
            if out and not text.strip():
                continue
            part = {**part, "text": text} if out else part
        parts.append(part)
    if not taken:
        return message, []
    return ({**message, "content": parts} if parts or message.get("tool_calls") else None), taken


def apply_rules(
    messages: Sequence[dict[str, Any]], rules: Sequence[VolatileRule]
) -> tuple[list[dict[str, Any]], list[str]]:
    """The messages with every rule applied (the same objects where nothing matched), and the
    names of the rules that changed them, in order."""
    out = list(messages)
    hits: list[str] = []
    for rule in rules:
        moved: list[str] = []
        changed = False
        result = []
        for m in out:
            if rule.scope == "system" and m.get("role") not in _SYSTEM_ROLES:
                result.append(m)
                continue
            new, taken = _apply(m, rule)
            if taken:
                changed = True
                moved += taken
            if new is not None:
                result.append(new)
        if not changed:
            continue
        if rule.action == "move_end" and result:
            result[-1] = _appended(result[-1], moved)
        out = result
        hits.append(rule.name)
    return out, hits


def _appended(message: dict[str, Any], lines: list[str]) -> dict[str, Any]:
    text = "\n".join(lines)
    content = message.get("content")
    if isinstance(content, list):
        return {**message, "content": [*content, {"type": "text", "text": text}]}
    base = content if isinstance(content, str) else ""
    return {**message, "content": f"{base}\n{text}" if base else text}

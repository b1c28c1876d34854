"""Volatile blocks: the built-in Claude Code billing rule, tenant rules (drop, move to the end;
system or every message) and the rules refused because they would match everything."""

from __future__ import annotations

import pytest

from engine_pool.protocol.volatile import (
    BUILTIN_RULES,
    RuleError,
    VolatileRule,
    apply_rules,
    literal_prefix,
    make_rule,
)

BILLING = "x-anthropic-billing-header: cc_version=2.1.37.3a3; cc_entrypoint=cli; cch={};"
PROMPT = "You are Claude Code, Anthropic's official CLI for Claude.\nBe brief."


def _system(nonce: str) -> list[dict]:
    # As the Messages API's system blocks reach the chat path: one system message, a line a block.
    return [
        {"role": "system", "content": BILLING.format(nonce) + "\n" + PROMPT},
        {"role": "user", "content": "hi"},
    ]


def test_the_billing_block_is_dropped_and_every_nonce_renders_the_same() -> None:
    a, hits = apply_rules(_system("1a2b3"), BUILTIN_RULES)
    b, _ = apply_rules(_system("ffff0"), BUILTIN_RULES)
    assert hits == ["claude-code-billing"]
    assert a == b == [{"role": "system", "content": PROMPT}, {"role": "user", "content": "hi"}]
    # Content parts (an OpenAI-shaped client relaying Claude Code) and a block that is all header.
    parts = [
        {
            "role": "system",
            "content": [{"type": "text", "text": BILLING.format("00000")}, {"type": "text", "text": PROMPT}],
        }
    ]
    out, hits = apply_rules(parts, BUILTIN_RULES)
    assert out == [{"role": "system", "content": [{"type": "text", "text": PROMPT}]}] and hits
    header_only = [{"role": "system", "content": BILLING.format("1")}, {"role": "user", "content": "x"}]
    alone, _ = apply_rules(header_only, BUILTIN_RULES)
    assert alone == [{"role": "user", "content": "x"}]


def test_nothing_matched_returns_the_same_objects() -> None:
    msgs = [{"role": "system", "content": PROMPT}, {"role": "user", "content": BILLING.format("0")}]
    out, hits = apply_rules(msgs, BUILTIN_RULES)
    assert hits == [] and all(x is y for x, y in zip(out, msgs, strict=True))  # user text: not its scope


def test_move_end_keeps_the_text_for_the_model_after_the_stable_part() -> None:
    rule = make_rule("date", r"^Today is \d{4}-\d{2}-\d{2}\.$", "move_end")
    msgs = [
        {"role": "system", "content": "Today is 2026-12-03.\n" + PROMPT},
        {"role": "user", "content": "hi"},
    ]
    out, hits = apply_rules(msgs, [rule])
    assert hits == ["date"]
    assert out == [
        {"role": "system", "content": PROMPT},
        {"role": "user", "content": "hi\nToday is 2026-12-03."},
    ]


def test_scope_all_reaches_every_message() -> None:
    rule = make_rule("stamp", r"^<stamp \d+>$", scope="all")
    msgs = [{"role": "user", "content": "<stamp 1>\nfix it"}, {"role": "assistant", "content": "ok"}]
    out, hits = apply_rules(msgs, [rule])
    assert out[0] == {"role": "user", "content": "fix it"} and hits == ["stamp"]


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (("all", ".*"), "matches every line"),
        (("all", "^"), "matches every line"),
        (("all", r"\w|\{"), "matches every line"),
        (("x", "("), "not a regular expression"),
        (("x", "a", "delete"), "'action'"),
        (("x", "a", "drop", "everywhere"), "'scope'"),
        (("bad name", "a"), "rule name"),
        (("x", "a" * 1001), "limit is 1000"),
        (("x", ""), "non-empty"),
    ],
)
def test_rules_that_cannot_be_used_are_refused(args, why) -> None:
    with pytest.raises(RuleError, match=why):
        make_rule(*args)


@pytest.mark.parametrize(
    ("pattern", "literal"),
    [
        (r"^x-anthropic-billing-header:\s", "x-anthropic-billing-header:"),
        (r"^Request-Id: [0-9a-f]+$", "Request-Id: "),
        (r"^\.\.\.done", "...done"),
        (r"hel+o", "hel"),  # `+`: at least one
        (r"abcd*", "abc"),  # `*`: the last character may be absent
        (r"ab|cd", None),
        (r"(?i)hello", None),
        (r"\d+ items", None),
        (r"ab", None),  # too short to be worth it
    ],
)
def test_the_literal_every_match_contains(pattern: str, literal: str | None) -> None:
    assert literal_prefix(pattern) == literal


def test_the_literal_shortcut_never_changes_a_result() -> None:
    text = "Request-Id: 0a1b\nkeep me\nRequest-Id: zz\n"
    fast = make_rule("id", r"^Request-Id: [0-9a-f]+$")
    slow = VolatileRule("id", fast.pattern)  # no literal: every line searched
    for messages in ([{"role": "system", "content": text}], [{"role": "system", "content": "keep me"}]):
        assert apply_rules(messages, [fast]) == apply_rules(messages, [slow])


def test_lines_end_at_newlines_with_or_without_a_carriage_return() -> None:
    crlf = [{"role": "system", "content": "a\r\n" + BILLING.format("9") + "\r\nb\r\n"}]
    assert apply_rules(crlf, BUILTIN_RULES)[0] == [{"role": "system", "content": "a\r\nb\r\n"}]
    last = [{"role": "system", "content": "a\n" + BILLING.format("9")}]  # no line break after it
    assert apply_rules(last, BUILTIN_RULES)[0] == [{"role": "system", "content": "a\n"}]
    twice = [{"role": "system", "content": BILLING.format("1") + "\nx\n" + BILLING.format("2") + "\ny"}]
    assert apply_rules(twice, BUILTIN_RULES)[0] == [{"role": "system", "content": "x\ny"}]
    mention = [{"role": "system", "content": "Never send x-anthropic-billing-header: it is ours.\nok"}]
    assert apply_rules(mention, BUILTIN_RULES)[1] == []  # not at a line's start: no match

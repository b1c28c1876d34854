"""formats/nemotron_h.py: Nemotron-H's `<TOOLCALL>[...]</TOOLCALL>` calls read, written and forced."""

from __future__ import annotations

import json

from engine_pool.server.formats import FORMATS, select_format
from engine_pool.server.formats.nemotron_h import parse_block, write_calls


def test_a_list_of_calls_is_read_and_anything_else_is_not_a_call() -> None:
    calls = parse_block('[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": "{}"}]', {})
    assert calls is not None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("a", {"x": 1}),
        ("b", {}),
    ]
    for bad in ("", "[]", "not json", '[{"arguments": {}}]', "[1]", '{"name": ""}'):
        assert parse_block(bad, {}) is None, bad


def test_written_calls_read_back() -> None:
    text = write_calls([("get_time", {"tz": "utc"}), ("f", {})])
    assert text.startswith("<TOOLCALL>[") and text.endswith("]</TOOLCALL>")
    calls = parse_block(text.removeprefix("<TOOLCALL>").removesuffix("</TOOLCALL>"), {})
    assert calls is not None and [c.name for c in calls] == ["get_time", "f"]


def test_the_template_picks_it_and_the_forced_call_opens_the_list() -> None:
    assert select_format("auto", "... '<TOOLCALL>[' ... ']</TOOLCALL>' ...").name == "nemotron-h"
    grammar = FORMATS["nemotron-h"].grammar(
        [("get_time", {"type": "object", "properties": {"tz": {"type": "string"}}})]
    )
    assert '"<TOOLCALL>[{\\"name\\": \\"get_time\\", \\"arguments\\": "' in grammar

"""Which session a request names: our header, the signals agents send (Claude Code, Codex,
prompt_cache_key) in their documented precedence, each bounded and scoped by the agent's shared
prefix, so an agent's title or sub-agent request never lands on its conversation's session."""

from __future__ import annotations

import pytest

from engine_pool.errors import BadRequest
from gateway.turn.signals import MAX_SIGNAL_CHARS, SIGNALS, session_key

MAIN, SUB = (lambda: "main-prefix"), (lambda: "subagent-prefix")


def test_precedence_follows_the_table() -> None:
    headers = {
        "x-session-id": "mine",
        "x-claude-code-session-id": "cc",
        "session_id": "cx",
        "session-id": "cx2",
    }
    body = {"prompt_cache_key": "pck"}
    assert session_key(headers, body, MAIN) == ("mine", "header")
    del headers["x-session-id"]
    cc, source = session_key(headers, body, MAIN)
    assert source == "claude-code" and cc.startswith("cc-")
    del headers["x-claude-code-session-id"]
    cx, source = session_key(headers, body, MAIN)
    assert source == "codex" and cx.startswith("cx-")
    del headers["session_id"]
    assert session_key(headers, body, MAIN)[1] == "codex"  # session-id, as newer Codex sends it
    assert session_key({}, body, MAIN)[0].startswith("pck-")
    assert session_key({}, {}, MAIN) == (None, "implicit")
    assert [s.source for s in SIGNALS] == [
        "header",
        "claude-code",
        *["codex"] * 5,
        "prompt_cache_key",
    ]


CODEX_ID = "01a24957-b511-70f2-932d-a0fc4a628eef"


def test_codex_thread_and_session_ids_in_its_precedence() -> None:
    """Codex 0.171 sends the same id as `session-id` and `thread-id` headers, in `client_metadata`
    (session_id, thread_id) and as `prompt_cache_key`: all name one session, the one its
    `session-id` header alone named before; a thread of its own (a sub-agent) gets its own."""
    before = session_key({"session-id": CODEX_ID}, {}, MAIN)
    headers = {"session-id": CODEX_ID, "thread-id": CODEX_ID}
    meta = {"client_metadata": {"session_id": CODEX_ID, "thread_id": CODEX_ID}, "prompt_cache_key": CODEX_ID}
    assert session_key(headers, meta, MAIN) == before
    assert session_key({}, meta, MAIN) == before  # the body alone: the same session
    assert session_key({}, {"client_metadata": {"session_id": CODEX_ID}}, MAIN) == before
    # A sub-agent's thread in the same CLI session: the thread wins over the session.
    sub = session_key({"session-id": CODEX_ID, "thread-id": "thread-2"}, {}, MAIN)
    assert sub[1] == "codex" and sub != before
    assert (
        session_key({}, {"client_metadata": {"session_id": CODEX_ID, "thread_id": "thread-2"}}, MAIN) == sub
    )
    # Other metadata is no signal; metadata that is no object is none either.
    assert session_key({}, {"client_metadata": {"turn_id": "t"}}, MAIN) == (None, "implicit")
    assert session_key({}, {"client_metadata": ["thread_id"]}, MAIN) == (None, "implicit")


def test_agent_signals_are_scoped_by_the_shared_prefix_and_ours_is_not() -> None:
    cc = {"x-claude-code-session-id": "2b9d1c4e-0000-4000-8000-000000000000"}
    main, sub = session_key(cc, {}, MAIN)[0], session_key(cc, {}, SUB)[0]
    assert main != sub  # a sub-agent (its own system prompt) gets its own session
    assert session_key(cc, {}, MAIN)[0] == main  # every turn of the conversation the same one
    assert session_key({"x-session-id": "s1"}, {}, MAIN) == session_key({"x-session-id": "s1"}, {}, SUB)
    # The same value in two signals names two sessions.
    assert (
        session_key({"session_id": "v"}, {}, MAIN)[0] != session_key({}, {"prompt_cache_key": "v"}, MAIN)[0]
    )


def test_the_scope_is_only_computed_for_an_agent_signal() -> None:
    def boom() -> str:
        raise AssertionError("not needed")

    assert session_key({"x-session-id": "s"}, {}, boom) == ("s", "header")
    assert session_key({}, {}, boom) == (None, "implicit")


@pytest.mark.parametrize(
    ("headers", "body", "param"),
    [
        ({"x-session-id": "a/b"}, {}, "X-Session-Id"),
        ({"x-session-id": "x" * 200}, {}, "X-Session-Id"),
        ({"x-claude-code-session-id": "x" * (MAX_SIGNAL_CHARS + 1)}, {}, "x-claude-code-session-id"),
        ({"x-claude-code-session-id": "  "}, {}, "x-claude-code-session-id"),
        ({"session_id": "caf\u00e9"}, {}, "session_id"),
        ({"session-id": "a\tb"}, {}, "session-id"),
        ({}, {"prompt_cache_key": 7}, "prompt_cache_key"),
        ({}, {"prompt_cache_key": ""}, "prompt_cache_key"),
        ({}, {"prompt_cache_key": "k" * 10_000}, "prompt_cache_key"),
        ({"thread-id": "t\nx"}, {}, "thread-id"),
        ({}, {"client_metadata": {"thread_id": 5}}, "client_metadata.thread_id"),
        ({}, {"client_metadata": {"session_id": "s" * (MAX_SIGNAL_CHARS + 1)}}, "client_metadata.session_id"),
    ],
)
def test_hostile_signals_are_refused_precisely(headers, body, param) -> None:
    with pytest.raises(BadRequest) as err:
        session_key(headers, body, MAIN)
    assert err.value.status == 400 and err.value.param == param

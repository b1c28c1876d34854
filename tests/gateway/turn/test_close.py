"""gateway.turn.close: what finishing a turn writes (the pure decision), and what a refused turn leaves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from gateway.tenants import Durability, Tenant
from gateway.turn.close import bookkeeping
from gateway.turn.engine_call import TurnOutcome
from gateway.turn.parts import Turn
from gateway.turn.prompt import Prompt
from gateway.turn.slot_choice import Placement, Serve

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def _turn(durability: Durability = Durability.AFTER_TURN) -> Turn:
    prompt = Prompt(MESSAGES, "m", {})
    tenant = Tenant("t", durability=durability)
    placement = Placement("e1", 0, Serve.LIVE)
    hold = node = None  # (finishing decides without them)
    return Turn(
        tenant,
        "s",
        "m",
        hold,
        placement,
        "http://e1",
        node,
        "header",
        inflight="place-1",  # type: ignore[arg-type]
        shared="shared-digest",
        prompt=prompt,
    )


def test_an_answered_turn_records_routes_usage_and_a_save() -> None:
    outcome = TurnOutcome(ok=True, content="hello", usage={"prompt_tokens": 7, "completion_tokens": 2})
    books = bookkeeping(_turn(), MESSAGES, outcome, shares=True, last_user=True)
    assert books.save and not books.release  # the save holds the lock on
    assert books.tokens == 9 and books.route == books.digests[-1] and books.identical
    assert (books.shared, books.inflight) == ("shared-digest", "place-1")
    assert books.usage == {"requests": 1, "prompt_tokens": 7, "completion_tokens": 2}
    assert books.head == _turn().prompt.head and books.routes == [*books.digests, books.head]  # type: ignore[union-attr]
    alone = bookkeeping(_turn(), MESSAGES, outcome, shares=False, last_user=True)
    assert alone.identical is None  # a tenant whose sessions do not share names no prompt to others
    assert alone.head == books.head  # ... but every session keeps where its next turn goes on from
    on_evict = bookkeeping(_turn(Durability.ON_EVICT), MESSAGES, outcome, shares=True, last_user=True)
    assert not on_evict.save and on_evict.release


def test_a_failed_turn_records_nothing_but_gives_its_place_and_lock_back() -> None:
    books = bookkeeping(_turn(), MESSAGES, TurnOutcome(error="timeout"), shares=True, last_user=True)
    assert (books.save, books.release, books.inflight) == (False, True, "place-1")
    assert (books.digests, books.shared, books.identical, books.head, dict(books.usage), books.tokens) == (
        (),
        None,
        None,
        None,
        {},
        None,
    )
    held = bookkeeping(_turn(), MESSAGES, TurnOutcome(error="timeout"), shares=True, last_user=False)
    assert not held.release  # a pending save of the previous turn still holds the lock


def test_a_new_sessions_turn_the_engine_refused_leaves_no_record(serve: Any, tmp_path: Path) -> None:
    """Refused before it ran (a malformed field the engine reads, a prompt past the context), a new
    session's first turn leaves nothing to list and nothing counted toward the tenant's sessions;
    a session that had state keeps its record."""
    s = serve(tmp_path / "data")
    hello = [{"role": "user", "content": "hi"}]
    for name, body in (
        ("malformed", {"messages": hello, "max_tokens": "ten"}),
        ("too-long", {"messages": [{"role": "user", "content": "x " * 5000}], "max_tokens": 4}),
    ):
        r = httpx.post(
            s.url + "/v1/chat/completions",
            json={"model": "m", **body},
            headers={"X-Session-Id": name},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        assert httpx.get(f"{s.url}/v1/sessions/{name}", timeout=10).status_code == 404
    ok = {"model": "m", "messages": hello, "max_tokens": 2}
    assert httpx.post(
        s.url + "/v1/chat/completions", json=ok, headers={"X-Session-Id": "kept"}, timeout=60
    ).is_success
    bad = {**ok, "max_tokens": "ten"}
    r = httpx.post(s.url + "/v1/chat/completions", json=bad, headers={"X-Session-Id": "kept"}, timeout=60)
    assert r.status_code == 400
    assert httpx.get(f"{s.url}/v1/sessions/kept", timeout=10).json()["tokens"] > 0
    listed = httpx.get(f"{s.url}/v1/sessions", timeout=10).json()
    assert [entry["id"] for entry in listed["data"]] == ["kept"], listed

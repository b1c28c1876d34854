"""Branches, never rollbacks (gateway.turn.branch): a turn continues the session it reached only from the
state that session's last turn left; any other turn branches from it. The decision on its own, its
effects on the index in process, and agents' conversations through a real `slotkeeper serve`."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import fakeredis
import httpx
import openai
import pytest

from engine_pool.errors import Unavailable
from gateway.cluster import Cluster
from gateway.metrics import Metrics
from gateway.tenants import Tenant
from gateway.turn.branch import Continuation, continuation, continues, looks_further
from gateway.turn.parts import TurnParts, TurnSettings
from gateway.turn.prompt import Prompt, finished_digests, route_lookup, turn_digests
from gateway.turn.runner import TurnRunner
from storage.blobs.localstore import LocalStore
from storage.index.engines import EngineRegistry
from storage.index.locks import SessionLocks
from storage.index.records import SessionRecord, SessionState
from storage.index.session_index import SessionIndex

from ..conftest import READ_FILE, Serve, anthropic_client, openai_client

SYSTEM = {"role": "system", "content": "You are a careful coding agent."}
TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]


def _prompt(messages: list[dict[str, Any]], tools: Any = TOOLS) -> Prompt:
    return Prompt(messages, "m", {"messages": messages}, tools)


def _after(messages: list[dict[str, Any]], tools: Any = TOOLS) -> SessionRecord:
    """The record of a session whose last turn's prompt was `messages`."""
    head = _prompt(messages, tools).head
    assert head is not None
    return SessionRecord("t", "s", SessionState.LIVE, head=head)


# -- the decision -------------------------------------------------------------------------------
def test_a_turn_continues_from_its_sessions_last_prompt_and_reply() -> None:
    first = [SYSTEM, {"role": "user", "content": "fix the bug"}]
    record = _after(first)
    reply = {"role": "assistant", "content": "Done."}
    assert continues(record, _prompt([*first, reply, {"role": "user", "content": "thanks"}]))
    # The reply is the one place that may come back in another form: templates render it again.
    other_form = {"role": "assistant", "content": "Done. ", "reasoning_content": "it was easy"}
    assert continues(record, _prompt([*first, other_form, {"role": "user", "content": "thanks"}]))
    # ... which is told apart from the reply the session recorded (its route).
    routed = replace(record, route=turn_digests([*first, reply], "m")[-1])
    assert (
        continuation(routed, _prompt([*first, reply, {"role": "user", "content": "x"}])) is Continuation.EXACT
    )
    assert continuation(routed, _prompt([*first, other_form, {"role": "user", "content": "x"}])) is (
        Continuation.REPLY
    )
    # A session whose turns went on elsewhere (another replica answered) still goes on from here.
    later = [*first, reply, {"role": "user", "content": "next"}, reply, {"role": "user", "content": "more"}]
    assert continues(record, _prompt(later))
    # The same prompt again (a regenerate, a retry) gives up only the reply: it runs there too.
    assert continuation(record, _prompt(first)) is Continuation.EXACT
    # Nothing to keep: no record, a record no turn finished on, a request that is not a chat.
    assert continues(None, _prompt(first))
    assert continues(SessionRecord("t", "s", SessionState.NEW), _prompt(first))
    assert continues(record, None)


def test_every_other_turn_that_reaches_a_session_branches() -> None:
    opening = [SYSTEM, {"role": "user", "content": "env: linux"}, {"role": "assistant", "content": "OK."}]
    a1 = [*opening, {"role": "user", "content": "task A"}]
    record = _after(a1)
    reply = {"role": "assistant", "content": "A done"}
    cases = {
        "a parallel conversation that opens alike": [*opening, {"role": "user", "content": "task B"}],
        "an edited earlier message": [
            SYSTEM,
            {"role": "user", "content": "env: mac"},
            *a1[2:],
            reply,
            {"role": "user", "content": "next"},
        ],
        "the conversation cut back": opening,
        "a user message where the reply was": [*a1, {"role": "user", "content": "again"}],
    }
    for why, messages in cases.items():
        assert not continues(record, _prompt(messages)), why
    # The same conversation under other tools renders other tokens from the top: a branch too.
    assert not continues(record, _prompt([*a1, reply, {"role": "user", "content": "x"}], tools=None))


def test_implicit_routing_finds_a_conversation_by_its_turns_and_by_its_heads() -> None:
    first = [SYSTEM, {"role": "user", "content": "hi"}]
    reply = {"role": "assistant", "content": "hello"}
    resent = [*first, reply, {"role": "user", "content": "more"}]
    lookup = _prompt(resent).lookup
    assert lookup[0] == turn_digests([*first, reply], "m")[-1]  # the complete turn first ...
    assert lookup[1] == _prompt(first).head  # ... then the head before its reply
    assert _prompt(first).lookup == []  # no reply yet: nothing routes (a new conversation)
    # A reply sent back in another form is still found, by the head.
    other = [*first, {"role": "assistant", "content": "hello!"}, {"role": "user", "content": "more"}]
    assert _prompt(other).lookup[1] == lookup[1] and _prompt(other).lookup[0] != lookup[0]
    prompt = _prompt(resent)
    assert route_lookup(prompt.chain, resent, prompt.tools_key) == lookup


def test_named_sessions_look_for_the_branch_they_continue() -> None:
    for named in ("header", "claude-code", "codex", "prompt_cache_key"):
        assert looks_further(named)
    for found in ("implicit", "new", "fork", "branch", "previous_response"):
        assert not looks_further(found)


# -- in process: what branching leaves in the index -----------------------------------------------
@pytest.fixture
async def runner(tmp_path: Path) -> Any:
    redis = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    index, locks = SessionIndex(redis), SessionLocks(redis)
    async with httpx.AsyncClient() as http:
        cluster = Cluster(EngineRegistry(redis), index, (), http)
        settings = TurnSettings(lock_ttl_s=5, spill_wait_s=1.0)
        yield TurnRunner(
            TurnParts(cluster, index, locks, LocalStore(tmp_path / "blobs"), Metrics(), settings)
        )
    await redis.aclose()


async def test_a_branch_leaves_the_session_it_reached_idle_in_its_slot_and_unlocked(runner: Any) -> None:
    """The opening read marked the reached session busy; branching leaves it as it was (idle, its
    head kept) before the branch is placed. Here no engine is registered, so placing the branch
    fails — and leaves no record behind either."""
    index, locks = runner.parts.index, runner.parts.locks
    first = [SYSTEM, {"role": "user", "content": "task A"}]
    await index.create("t", "a", model="m")
    await index.mark_live("t", "a", engine="e1", slot=0, tokens=10, model="m")
    await index.transition("t", "a", index.decide_idle("a", head=_prompt(first).head), idle=True)
    before = await index.get("t", "a")
    other = _prompt([SYSTEM, {"role": "user", "content": "task B"}])
    with pytest.raises(Unavailable):
        await runner.start(Tenant("t"), {}, {}, "m", other, ("a", "implicit"))
    assert runner.parts.metrics.branches.labels("implicit")._value.get() == 1
    after = await index.get("t", "a")
    assert (after.state, after.engine, after.slot, after.head, after.tokens) == (
        SessionState.LIVE,
        "e1",
        0,
        before.head,
        10,
    )
    assert await index.is_idle("t", "a")
    assert await locks.owner("t", "a") is None and runner.parts.holds.get("t", "a") is None
    assert await index.list_sessions("t") == ["a"]


async def test_a_next_turn_sent_the_moment_its_answer_arrives_finds_the_session(runner: Any) -> None:
    """A turn's routes are written beside its answer going out: a lookup by history (implicit, or a
    named session's search for its branch) waits for this process's pending bookkeeping that may
    write what it looks for, rather than miss the session by a round trip and branch anew."""
    index, locks, holds = runner.parts.index, runner.parts.locks, runner.parts.holds
    first = [SYSTEM, {"role": "user", "content": "task A"}]
    reply = {"role": "assistant", "content": "A done"}
    await index.create("t", "a", model="m")
    lock = await locks.try_acquire("t", "a", ttl_s=5)
    assert lock is not None
    hold = holds.start(lock, None)
    holds.answered(hold)  # the answer goes out; its bookkeeping has not been written yet
    nxt = [*first, reply, {"role": "user", "content": "next"}]
    lookup = asyncio.create_task(runner.resolve(Tenant("t"), {}, {"messages": nxt}, _prompt(nxt)))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not lookup.done()
    routes, _ = finished_digests(first, reply, TOOLS, "m")
    await index.add_prefixes("t", "a", [*routes, _prompt(first).head])
    holds.booked(hold)
    assert await asyncio.wait_for(lookup, 5) == ("a", "implicit")
    # With nothing being written, a lookup does not wait.
    again = await runner.resolve(Tenant("t"), {}, {"messages": nxt}, _prompt(nxt))
    assert again == ("a", "implicit")
    await holds.let_go(hold)


# -- through a real serve -----------------------------------------------------------------------
ENV = "Environment: linux, python 3.11, repository at /work/app. Tests run with pytest. " * 3
OPENING = [
    {"role": "system", "content": "You are a coding agent in a terminal. Answer briefly. " * 6},
    {"role": "user", "content": ENV},
    {"role": "assistant", "content": "Understood. What is the task?"},
]


def _turn(
    client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int = 6, **headers: str
) -> tuple[Any, dict[str, str]]:
    raw = client.chat.completions.with_raw_response.create(
        model="agent",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
        extra_headers=headers,
    )
    return raw.parse(), dict(raw.headers)


def _reply(answer: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": answer.choices[0].message.content or ""}


def _reused(answer: Any, previous: Any) -> float:
    """The share of the previous turn's prompt this turn read from cache."""
    cached = answer.usage.prompt_tokens_details.cached_tokens
    return float(cached) / float(previous.usage.prompt_tokens)


def test_two_conversations_that_open_alike_never_roll_each_other_back(
    serve: Callable[..., Serve], tmp_path: Path
) -> None:
    """A chat-completions agent without a session header: conversations A and B start with the same
    system prompt, environment message and acknowledgement, then their own task. Interleaved A1 B1
    A2 B2, then A3 and B3 at once: B1 branches from A (A's state stays), each then goes on with full
    reuse in its own session, and the concurrent turns run in two slots."""
    s = serve(tmp_path / "data", slots=3)
    client = openai_client(s.url)
    a = [*OPENING, {"role": "user", "content": "Task A: the login test fails with a KeyError. Find why."}]
    b = [*OPENING, {"role": "user", "content": "Task B: add a --verbose flag to the CLI and document it."}]
    a1, ha1 = _turn(client, a)
    b1, hb1 = _turn(client, b)
    session_a, session_b = ha1["x-session-id"], hb1["x-session-id"]
    assert session_b != session_a and hb1["x-slotkeeper-branch-of"] == session_a
    assert b1.usage.prompt_tokens_details.cached_tokens > 0  # the opening, from A's state
    a += [_reply(a1), {"role": "user", "content": "Run the test again and show the traceback."}]
    b += [_reply(b1), {"role": "user", "content": "Now write the documentation for it."}]
    a2, ha2 = _turn(client, a)
    b2, hb2 = _turn(client, b)
    assert (ha2["x-session-id"], hb2["x-session-id"]) == (session_a, session_b)
    assert "x-slotkeeper-branch-of" not in ha2 and "x-slotkeeper-branch-of" not in hb2
    assert _reused(a2, a1) >= 0.95 and _reused(b2, b1) >= 0.95
    a += [_reply(a2), {"role": "user", "content": "Fix it."}]
    b += [_reply(b2), {"role": "user", "content": "Ship it."}]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        third_a = pool.submit(_turn, openai_client(s.url), a)
        third_b = pool.submit(_turn, openai_client(s.url), b)
        (a3, ha3), (b3, hb3) = third_a.result(), third_b.result()
    assert (ha3["x-session-id"], hb3["x-session-id"]) == (session_a, session_b)
    assert _reused(a3, a2) >= 0.95 and _reused(b3, b2) >= 0.95


def test_an_edit_under_an_agents_session_id_branches_and_both_sides_go_on(
    serve: Callable[..., Serve], tmp_path: Path
) -> None:
    """An agent that sends its session id (Codex's `session_id` header) edits its last message and
    sends it again: the session keeps its state and the edit is a branch. Going on under the same id,
    the branch's history finds the branch, and the original history its own session, each with full
    reuse. A regenerate (the same prompt again) stays on its session."""
    s = serve(tmp_path / "data", slots=3)
    client = openai_client(s.url)
    signal = {"session_id": "0198-agent-1"}
    history = [*OPENING, {"role": "user", "content": "Task: rename the module utils to text."}]
    t1, h1 = _turn(client, history, **signal)
    history += [_reply(t1), {"role": "user", "content": "Now update the imports."}]
    t2, h2 = _turn(client, history, **signal)
    session = h1["x-session-id"]
    assert session.startswith("cx-") and h2["x-session-id"] == session
    again, ha = _turn(client, history, **signal)  # the same prompt again: a regenerate
    assert ha["x-session-id"] == session and ha["x-slotkeeper-cache"] == "live"
    edited = [*history[:-1], {"role": "user", "content": "Now update the imports and the docs."}]
    e1, he = _turn(client, edited, **signal)
    branch = he["x-session-id"]
    assert branch != session and he["x-slotkeeper-branch-of"] == session
    assert e1.usage.prompt_tokens_details.cached_tokens >= 0.8 * t1.usage.prompt_tokens
    on_branch = [*edited, _reply(e1), {"role": "user", "content": "Good, continue."}]
    e2, he2 = _turn(client, on_branch, **signal)
    assert he2["x-session-id"] == branch and "x-slotkeeper-branch-of" not in he2
    assert _reused(e2, e1) >= 0.95
    original = [*history, _reply(again), {"role": "user", "content": "Good, continue."}]
    t3, h3 = _turn(client, original, **signal)
    assert h3["x-session-id"] == session and _reused(t3, again) >= 0.95


def test_an_agents_side_request_under_its_conversations_id_never_takes_the_conversation(
    serve: Callable[..., Serve], tmp_path: Path
) -> None:
    """OpenCode sends its conversation's `X-Session-Id` on its title request too, first or beside the
    conversation's first call. Whichever holds the id, the conversation keeps its own session under
    it with full reuse, and a new conversation of the same agent starts from the first one's system
    prompt and tools."""
    s = serve(tmp_path / "data", slots=4)
    client = openai_client(s.url)
    title_system = {"role": "system", "content": "You write a short title for a conversation."}

    def title(first: str, named: dict[str, str]) -> None:
        _turn(client, [title_system, {"role": "user", "content": first}], **named)

    first = "Task: rename the module utils to text."
    named = {"X-Session-Id": "ses_1"}
    title(first, named)
    history = [*OPENING, {"role": "user", "content": first}]
    t1, h1 = _turn(client, history, **named)
    conversation = h1["x-session-id"]
    assert conversation != "ses_1" and h1["x-slotkeeper-branch-of"] == "ses_1"
    history += [_reply(t1), {"role": "user", "content": "Now update the imports."}]
    t2, h2 = _turn(client, history, **named)  # (`--continue`: the same id again)
    assert h2["x-session-id"] == conversation and _reused(t2, t1) >= 0.95
    title(first, named)  # a side request again, on the session the id names
    history += [_reply(t2), {"role": "user", "content": "Run the tests."}]
    t3, h3 = _turn(client, history, **named)
    assert h3["x-session-id"] == conversation and _reused(t3, t2) >= 0.95
    # A new conversation: its title first, then its first call, which starts from the first one's
    # system prompt and tools (a slot of the tenant's on the same engine).
    other = {"X-Session-Id": "ses_2"}
    title("Task: add a --verbose flag.", other)
    new = [*OPENING, {"role": "user", "content": "Task: add a --verbose flag."}]
    n1, hn1 = _turn(client, new, **other)
    assert hn1["x-session-id"] not in ("ses_1", "ses_2", conversation)
    opening = n1.usage.prompt_tokens_details.cached_tokens / n1.usage.prompt_tokens
    assert opening >= 0.8, n1.usage


def test_a_compacted_claude_code_conversation_branches_and_keeps_its_sub_agents_apart(
    serve: Callable[..., Serve], tmp_path: Path
) -> None:
    """Claude Code's shapes (reconstructed: the tiny model never finishes a summary for the real CLI,
    tests/gateway/agent_clis): its `/compact` request sends the same system prompt and tools, the
    whole history and a summary request, under the conversation's session header: it reads the whole
    prompt from cache. The compacted conversation's first turn, under the same header, starts with the
    summary instead of the history: a branch that reuses the system prompt and tools, and its next
    turn goes on in that branch. A sub-agent (its own system prompt, the same header) is a session of
    its own and leaves the conversation live in its slot."""
    s = serve(tmp_path / "data", slots=4)
    client = anthropic_client(s.url)
    headers = {"x-claude-code-session-id": "3f6c1f4e-compact"}
    system = "You are Claude Code, an interactive CLI tool for software engineering tasks. " * 8

    def send(messages: list[dict[str, Any]], system: str = system) -> tuple[Any, dict[str, str]]:
        raw = client.messages.with_raw_response.create(
            model="claude-sonnet-4-5",
            max_tokens=6,
            system=system,
            tools=[READ_FILE],  # type: ignore[list-item]
            messages=messages,  # type: ignore[arg-type]
            extra_headers=headers,
            extra_body={"temperature": 0},
        )
        return raw.parse(), dict(raw.headers)

    def text(message: Any) -> str:
        return "".join(b.text for b in message.content if b.type == "text") or "ok"

    def read(message: Any) -> int:
        return int(message.usage.cache_read_input_tokens or 0)

    history: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing login test."}]
    first, h1 = send(history)
    session = h1["x-session-id"]
    history += [{"role": "assistant", "content": text(first)}, {"role": "user", "content": "Run it again."}]
    second, h2 = send(history)
    assert h2["x-session-id"] == session and read(second) >= 0.95 * first.usage.input_tokens
    # A sub-agent between two turns: a session of its own; the conversation stays where it was.
    _, hs = send([{"role": "user", "content": "Find the config loader."}], system="You are a search agent.")
    assert hs["x-session-id"] != session
    history += [{"role": "assistant", "content": text(second)}, {"role": "user", "content": "And the docs."}]
    third, h3 = send(history)
    assert h3["x-session-id"] == session and h3["x-slotkeeper-cache"] == "live"
    before = second.usage.input_tokens + read(second)
    assert read(third) >= 0.95 * before
    # /compact: the whole history and a summary request, the same session.
    summary_request = "Your task is to create a detailed summary of the conversation so far."
    compact_history = [*history, {"role": "assistant", "content": text(third)}]
    compacting, hc = send([*compact_history, {"role": "user", "content": summary_request}])
    assert hc["x-session-id"] == session and read(compacting) >= 0.95 * (
        third.usage.input_tokens + read(third)
    )
    # The compacted conversation: the summary instead of the history, under the same header.
    summary = "This session is being continued from a previous conversation. Summary: " + text(compacting)
    compacted: list[dict[str, Any]] = [{"role": "user", "content": summary + "\n\nNow update the changelog."}]
    after, ha = send(compacted)
    branch = ha["x-session-id"]
    assert branch != session and ha["x-slotkeeper-branch-of"] == session
    prefix = client.messages.count_tokens(  # system + tools + one word
        model="claude-sonnet-4-5",
        system=system,
        tools=[READ_FILE],  # type: ignore[list-item]
        messages=[{"role": "user", "content": "x"}],
    ).input_tokens
    assert read(after) >= 0.9 * prefix
    compacted += [{"role": "assistant", "content": text(after)}, {"role": "user", "content": "Thanks."}]
    going_on, hg = send(compacted)
    assert hg["x-session-id"] == branch and read(going_on) >= 0.95 * (after.usage.input_tokens + read(after))

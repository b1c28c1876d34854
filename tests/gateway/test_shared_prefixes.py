"""Reuse as agent traffic arrives, through `slotkeeper serve` with the real clients: new sessions of
a tenant start from its shared system prompt and tools (from a live slot on the same engine, or
from storage after a restart), never from another tenant's; Claude Code's volatile billing block
and its session header, Codex's Responses shape with `prompt_cache_key` and `session_id`; a tenant
rule; a damaged stored prefix; and the report of what was reused and where a turn missed."""

from __future__ import annotations

import concurrent.futures
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from support.redis_topology import TOPOLOGIES, topology

MODEL = "qwen35-seed0"
SYSTEM = (
    "You are a coding agent working in a large repository. Read the files you need, run the "
    "tests, fix what fails, and report briefly what you changed and why. "
) * 5
PATH = {"type": "object", "properties": {"path": {"type": "string"}}}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": n,
            "description": f"{n.replace('_', ' ')} in the repository",
            "parameters": PATH,
        },
    }
    for n in ("read_file", "write_file", "run_tests", "search_code")
]
ARGS = ("--ctx", "8192")
TENANTS = '[tenants.acme]\nkeys = ["key-acme"]\n[tenants.beta]\nkeys = ["key-beta"]\n'


def _chat(
    url: str,
    user: str,
    *,
    key: str = "none",
    headers: dict[str, str] | None = None,
    system: str = SYSTEM,
    tools: Any = TOOLS,
) -> httpx.Response:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
    if tools is not None:
        body["tools"] = tools
    r = httpx.post(
        url + "/v1/chat/completions",
        json=body,
        timeout=120,
        headers={"Authorization": f"Bearer {key}", **(headers or {})},
    )
    assert r.status_code == 200, r.text
    return r


def _own_share(r: httpx.Response) -> float:
    """The share of the prompt the turn evaluated."""
    body = r.json()
    return float(body["timings"]["prompt_n"]) / float(body["usage"]["prompt_tokens"])


def _wait_stored(url: str, session: str, key: str = "none") -> None:
    for _ in range(400):
        got = httpx.get(f"{url}/v1/sessions/{session}", headers={"Authorization": f"Bearer {key}"}).json()
        if int(got.get("generation", 0)) > 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"{session} was never stored")


@pytest.fixture(params=["in-process", *TOPOLOGIES])
def index_args(request: pytest.FixtureRequest) -> tuple[str, ...]:
    """`serve`'s flags with each index: in-process, one primary, a Redis Cluster, Sentinel."""
    if request.param == "in-process":
        return ARGS
    return (*ARGS, "--redis-url", topology(request, request.param).url)


def test_new_sessions_start_from_the_tenants_shared_prefix_live_and_after_a_restart(serve, tmp_path: Path):
    data = tmp_path / "data"
    s = serve(data, slots=4, args=ARGS)
    first = _chat(s.url, "Fix the failing test in parser.py.", headers={"X-Session-Id": "first"})
    assert first.headers["x-slotkeeper-cache"] == "cold" and first.json()["timings"]["cache_n"] == 0
    full = first.json()["usage"]["prompt_tokens"]
    # A new session however it is named: our header, none at all, Claude Code's.
    for i, headers in enumerate(
        ({"X-Session-Id": "second"}, {}, {"x-claude-code-session-id": "7f1c2a9e-cc"})
    ):
        r = _chat(s.url, f"Another task ({i}): update the changelog.", headers=headers)
        report = r.json()["slotkeeper"]
        assert r.headers["x-slotkeeper-cache"] == "prefix" and report["served"] == "prefix", report
        assert _own_share(r) < 0.25, r.json()["timings"]  # its own message, not the system prompt
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0.75 * full
        diverged = report.get("diverged") or {}
        assert diverged.get("part") == "message" and diverged.get("message") == 1, report
    _wait_stored(s.url, "second")

    s.stop(signal.SIGKILL)
    s = serve(data, slots=4, args=ARGS)  # a new process: nothing in any slot, the index rebuilt
    r = _chat(s.url, "After the restart: review the open pull request.")
    assert r.headers["x-slotkeeper-cache"] == "stored-prefix", r.json()["slotkeeper"]
    assert r.json()["slotkeeper"]["restored"] is True and _own_share(r) < 0.25, r.json()["timings"]
    metrics = httpx.get(s.url + "/metrics").text
    assert (
        'slotkeeper_gateway_tenant_prompt_tokens_total{kind="reused",served="stored-prefix",tenant="default"}'
        in metrics
    )


def test_another_tenant_with_the_same_prompt_gets_no_hit(serve, tmp_path: Path, index_args: tuple[str, ...]):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    s = serve(tmp_path / "data", slots=4, tenants=tenants, args=index_args)
    a = _chat(s.url, "Fix the failing test in parser.py.", key="key-acme")
    _wait_stored(s.url, a.headers["x-session-id"], "key-acme")
    again = _chat(s.url, "Another acme task.", key="key-acme")
    assert again.headers["x-slotkeeper-cache"] == "prefix"
    b = _chat(s.url, "Fix the failing test in parser.py.", key="key-beta")  # acme's exact prompt
    assert b.headers["x-slotkeeper-cache"] == "cold"
    assert b.json()["timings"]["cache_n"] == 0 and b.json()["slotkeeper"]["served"] == "cold"
    assert "source_slot" not in b.json()["slotkeeper"]


def test_eight_concurrent_new_sessions_share_one_prefix(serve, tmp_path: Path):
    s = serve(tmp_path / "data", slots=8, args=("--ctx", "16384"))
    _chat(s.url, "Warm up: list the files.")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: _chat(s.url, f"Task {i}: fix issue #{100 + i}."), range(8)))
    sessions = {r.headers["x-session-id"] for r in answers}
    assert len(sessions) == 8
    for r in answers:
        assert r.headers["x-slotkeeper-cache"] == "prefix" and _own_share(r) < 0.25, r.json()["timings"]
    # Each answer is what the same prompt gives from scratch (greedy), in a process of its own.
    fresh = serve(tmp_path / "fresh", slots=8, args=("--ctx", "16384"))
    for i in (0, 7):  # (the first one evaluated in full, the second from the first one's slot)
        scratch = _chat(
            fresh.url, f"Task {i}: fix issue #{100 + i}.", headers={"X-Session-Id": f"scratch{i}"}
        )
        assert scratch.json()["choices"][0]["message"] == answers[i].json()["choices"][0]["message"]


def test_a_tenant_rule_drops_a_volatile_block(serve, tmp_path: Path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(
        TENANTS + '[[tenants.acme.volatile]]\nname = "stamp"\npattern = "^Request-Id: [0-9a-f]+$"\n'
    )
    s = serve(tmp_path / "data", slots=2, tenants=tenants, args=ARGS)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
    last = 0
    for turn, stamp in enumerate(("0a1b2c", "ffee99", "123abc")):
        stamped = {"role": "system", "content": f"Request-Id: {stamp}\n" + SYSTEM}
        body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": [stamped, *msgs]}
        r = httpx.post(
            s.url + "/v1/chat/completions",
            json=body,
            timeout=120,
            headers={"Authorization": "Bearer key-acme", "X-Session-Id": "stamped"},
        )
        assert r.status_code == 200, r.text
        report = r.json()["slotkeeper"]
        assert report["rules"] == ["stamp"]
        if turn:
            assert report["served"] == "live" and r.json()["timings"]["cache_n"] >= last, r.json()["timings"]
        last = r.json()["usage"]["prompt_tokens"]
        msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": f"Now step {turn + 2}."}]
    assert 'slotkeeper_gateway_volatile_blocks_total{rule="stamp"} 3.0' in httpx.get(s.url + "/metrics").text


BILLING = "x-anthropic-billing-header: cc_version=2.1.37.3a3; cc_entrypoint=cli; cch={};"


def _claude_code_system(nonce: str) -> list[dict[str, Any]]:
    return [
        {"type": "text", "text": BILLING.format(nonce)},
        {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
        {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}},
    ]


ANTHROPIC_TOOLS: list[Any] = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]


@pytest.fixture
def claude(serve, tmp_path: Path) -> Iterator[tuple[Any, anthropic.Anthropic]]:
    s = serve(tmp_path / "data", slots=2, args=ARGS)
    client = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0)
    yield s, client
    client.close()


def test_claude_code_turns_reuse_the_whole_previous_turn_despite_its_nonce(claude):
    s, client = claude
    headers = {
        "x-claude-code-session-id": "3d1f5a3e-8b1e-4c1d-9a39-0f5c3f2d7c11",
        "x-app": "cli",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
        "User-Agent": "claude-cli/2.1.37 (external, cli)",
    }
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "Fix the build."}]}
    ]
    previous, sessions, previous_id = 0, set(), None
    for turn, nonce in enumerate(("1a2b3", "c4d5e", "0f9e8", "77aa1")):
        raw = client.messages.with_raw_response.create(
            model="claude-sonnet-4-5",
            max_tokens=4,
            system=_claude_code_system(nonce),
            tools=ANTHROPIC_TOOLS,
            messages=messages,
            extra_headers=headers,
            diagnostics={"previous_message_id": previous_id},
        )
        message = raw.parse()
        previous_id = message.id
        assert message.diagnostics is not None and message.diagnostics.cache_miss_reason is None  # no miss
        sessions.add(raw.headers["x-session-id"])
        usage = message.usage
        if turn:
            assert raw.headers["x-slotkeeper-cache"] == "live"
            assert usage.cache_read_input_tokens is not None and usage.cache_read_input_tokens >= previous, (
                usage
            )
        previous = usage.input_tokens + (usage.cache_read_input_tokens or 0)
        report = (message.model_extra or {})["slotkeeper"]
        assert report["rules"] == ["claude-code-billing"]
        text = "".join(b.text for b in message.content if b.type == "text") or "ok"
        messages += [
            {"role": "assistant", "content": [{"type": "text", "text": text}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": f"Turn {turn + 2}.", "cache_control": {"type": "ephemeral"}}
                ],
            },
        ]
    assert len(sessions) == 1 and next(iter(sessions)).startswith("cc-")
    # Its sub-agent (own system prompt, the same session header) is a session of its own, and the
    # conversation stays live in its slot.
    sub = client.messages.with_raw_response.create(
        model="claude-sonnet-4-5",
        max_tokens=4,
        system="You are a search sub-agent.",
        messages=[{"role": "user", "content": "Find the config loader."}],
        extra_headers=headers,
    )
    assert sub.headers["x-session-id"] not in sessions


def test_an_edited_earlier_message_is_named_as_the_miss(claude):
    s, client = claude
    headers = {"x-claude-code-session-id": "edit-test"}

    def send(nonce: str, messages: list[dict[str, Any]], **extra: Any) -> Any:
        return client.messages.create(
            model="claude-x",
            max_tokens=4,
            system=_claude_code_system(nonce),
            messages=messages,
            extra_headers=headers,
            **extra,
        )

    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the build."}]
    first = send("1", messages)
    messages += [
        {"role": "assistant", "content": first.content[0].text if first.content else "ok"},
        {"role": "user", "content": "And the docs."},
    ]
    second = send("2", messages)
    edited = [{"role": "user", "content": "Fix the build, then the tests."}, *messages[1:]]
    again = send("3", edited, diagnostics={"previous_message_id": second.id})
    diverged = (again.model_extra or {})["slotkeeper"]["diverged"]
    assert diverged["part"] == "message" and diverged["message"] == 1 and diverged["role"] == "user"
    # Anthropic's own shape of it, as its SDK reads it.
    assert again.diagnostics is not None and again.diagnostics.cache_miss_reason is not None
    assert again.diagnostics.cache_miss_reason.type == "messages_changed"
    assert again.diagnostics.cache_miss_reason.cache_missed_input_tokens > 0


def test_codex_shaped_responses_find_their_session_and_reuse_it(serve, tmp_path: Path):
    s = serve(tmp_path / "data", slots=2, args=ARGS)
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
    conversation = "0199c5b4-codex-conversation"
    items: list[Any] = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix it."}]}
    ]
    tools = [
        {
            "type": "function",
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "parameters": t["function"]["parameters"],
            "strict": False,
        }
        for t in TOOLS
    ]
    cached, sessions = [], set()
    try:
        for turn in range(3):
            raw = client.responses.with_raw_response.create(
                model="gpt-5-codex",
                instructions=SYSTEM,
                input=items,
                tools=tools,
                store=False,
                prompt_cache_key=conversation,
                max_output_tokens=4,
                temperature=0,
                extra_headers={"session_id": conversation, "originator": "codex_cli_rs"},
            )
            sessions.add(raw.headers["x-session-id"])
            response = raw.parse()
            assert response.usage is not None
            cached.append(response.usage.input_tokens_details.cached_tokens)
            items += [
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": response.output_text or "ok"}],
                },
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": f"Step {turn + 2}."}],
                },
            ]
    finally:
        client.close()
    assert len(sessions) == 1 and next(iter(sessions)).startswith("cx-")
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1], cached


def test_a_damaged_stored_prefix_falls_back_to_a_clean_re_prefill(serve, tmp_path: Path):
    data = tmp_path / "data"
    s = serve(data, slots=2, args=ARGS)
    _chat(s.url, "Fix the failing test in parser.py.", headers={"X-Session-Id": "holder"})
    _wait_stored(s.url, "holder")
    s.stop(signal.SIGKILL)
    pieces = [p for p in data.rglob("*.ck")]
    assert pieces, sorted(str(p) for p in data.rglob("*"))[:40]
    for piece in pieces:  # every stored checkpoint damaged, its name (and CRC) unchanged
        raw = bytearray(piece.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        piece.write_bytes(bytes(raw))
    s = serve(data, slots=2, args=ARGS)
    prompt = "Another task: update the changelog."
    r = _chat(s.url, prompt, headers={"X-Session-Id": "newcomer"})
    assert r.json()["timings"]["cache_n"] == 0 and r.headers["x-slotkeeper-cache"] == "cold"
    # The right answer: what the same prompt gives in a fresh process with nothing stored.
    clean = serve(tmp_path / "clean", slots=2, args=ARGS)
    expected = _chat(clean.url, prompt, headers={"X-Session-Id": "newcomer"})
    assert r.json()["choices"][0]["message"] == expected.json()["choices"][0]["message"]


def test_hostile_session_signals_and_rules_are_refused_precisely(serve, tmp_path: Path, tiny_model):
    import subprocess
    import sys

    s = serve(tmp_path / "data", slots=2)
    headers: dict[str, Any]
    for headers, param in (
        ({"x-claude-code-session-id": "x" * 257}, "x-claude-code-session-id"),
        ({"session_id": "\u00e9t\u00e9".encode()}, "session_id"),  # (bytes: httpx sends only ASCII text)
        ({"X-Session-Id": "../escape"}, "X-Session-Id"),
    ):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        r = httpx.post(s.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    catch_all = tmp_path / "catch-all.toml"
    catch_all.write_text(TENANTS + '[[tenants.acme.volatile]]\nname = "everything"\npattern = ".*"\n')
    cmd = [
        *(sys.executable, "-m", "gateway.cli", "serve"),
        *("--tenants", str(catch_all)),
        *("--model", tiny_model("qwen35")),
        *("--data-dir", str(tmp_path / "never")),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "matches every line" in proc.stderr, proc.stderr


def test_a_prompt_sent_again_without_a_session_costs_what_it_costs_with_one(serve, tmp_path: Path):
    """A client that sends the same prompt again and names no session (a retry, a second run of a
    script), here with no system prompt or tools to share, gets a new session that starts from the
    state of the one that served the prompt: it evaluates what the same prompt evaluates on its
    own session, live and after a restart, and answers alike (the same state, greedy)."""
    data = tmp_path / "data"
    s = serve(data, slots=4, args=ARGS)
    user = "Summarise the design of a storage engine that keeps sessions on disk. " * 6

    def chat(headers: dict[str, str] | None = None) -> httpx.Response:
        return _chat(s.url, user, system="", tools=None, headers=headers)

    first = chat()
    assert first.headers["x-slotkeeper-cache"] == "cold"
    owner = first.headers["x-session-id"]
    _wait_stored(s.url, owner)
    again = chat()  # no header, no prompt_cache_key
    assert again.headers["x-session-id"] != owner  # a session of its own: the first one is left as it is
    assert again.headers["x-slotkeeper-cache"] == "prefix", again.json()["slotkeeper"]
    named = chat({"X-Session-Id": owner})  # the same prompt on its own session
    assert named.headers["x-slotkeeper-cache"] == "live"
    assert again.json()["timings"]["prompt_n"] <= named.json()["timings"]["prompt_n"] + 1, (
        again.json()["timings"],
        named.json()["timings"],
    )
    assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]

    s.stop(signal.SIGKILL)
    s = serve(data, slots=4, args=ARGS)
    restored = chat()
    assert restored.headers["x-slotkeeper-cache"] == "stored-prefix", restored.json()["slotkeeper"]
    assert restored.json()["timings"]["prompt_n"] <= named.json()["timings"]["prompt_n"] + 1
    assert restored.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]

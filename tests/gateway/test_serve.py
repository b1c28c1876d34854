"""End to end through `slotkeeper serve` with the official openai client: sessions stay warm in a
slot, spill to the blob store and come back, across evictions and restarts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from support.bad_models import unloadable_model
from support.ready import wait_ready

from gateway.bench.harness.servers import INTERNAL_AUTH, free_port, wait_until

from .conftest import Serve, openai_client, serve_argv

MODEL = "qwen35-seed0"
SYSTEM = "You are a coding agent. Read files, run tests, fix bugs, and report briefly. " * 4


def _turn(client: openai.OpenAI, messages: list[dict], session: str | None = None):
    headers = {"X-Session-Id": session} if session else {}
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_headers=headers
    )
    done = raw.parse()
    timings = done.model_extra["timings"]
    assert all(isinstance(v, int | float) for v in timings.values()), timings  # llama-server's: numbers
    return done, raw.headers, timings


def test_implicit_routing_keeps_a_conversation_warm(serve, tmp_path: Path):
    s = serve(tmp_path / "data")
    client = openai_client(s.url)
    msgs = [{"role": "system", "content": SYSTEM}]
    session = None
    for turn in range(4):
        msgs.append({"role": "user", "content": f"Step {turn}: run the tests."})
        done, headers, timings = _turn(client, msgs)
        if session is None:
            session = headers["x-session-id"]
            assert headers["x-slotkeeper-cache"] == "cold"
        else:
            assert headers["x-session-id"] == session, "the resent history must land on its session"
            assert headers["x-slotkeeper-cache"] == "live"
            assert done.usage.prompt_tokens_details.cached_tokens == timings["cache_n"] > len(SYSTEM) // 8
        msgs.append({"role": "assistant", "content": done.choices[0].message.content})
    listed = httpx.get(s.url + "/v1/sessions").json()["data"]
    assert [d["id"] for d in listed] == [session]
    _wait_durable(s.url, session, 0)  # the last turn's write-behind save (the others gave way to it)


def test_streaming_passes_through_with_usage(serve, tmp_path: Path):
    s = serve(tmp_path / "data")
    client = openai_client(s.url)
    msgs = [{"role": "user", "content": "Say something."}]
    request: Any = {"model": MODEL, "messages": msgs, "max_tokens": 6, "temperature": 0}  # streamed and not
    with client.chat.completions.with_streaming_response.create(
        **request, stream=True, stream_options={"include_usage": True}
    ) as raw:
        assert raw.headers["x-slotkeeper-cache"] == "cold"
        chunks = list(raw.parse())
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = client.chat.completions.create(**request)
    assert plain.choices[0].message.content == text


def test_more_sessions_than_slots_evict_and_restore(serve, tmp_path: Path):
    s = serve(tmp_path / "data", slots=2)
    client = openai_client(s.url)
    convs = {f"agent-{i}": [{"role": "system", "content": SYSTEM + f" You are agent {i}."}] for i in range(4)}
    for turn in range(2):
        for sid, msgs in convs.items():
            msgs.append({"role": "user", "content": f"Turn {turn}: continue."})
            done, headers, timings = _turn(client, msgs, session=sid)
            assert headers["x-session-id"] == sid
            if turn == 0:
                assert headers["x-slotkeeper-cache"] == "cold"
            else:
                # Evicted by the two sessions after it: back from its slot file, reusing the checkpoint
                # at the end of its last prompt.
                assert headers["x-slotkeeper-cache"] == "restored"
                assert done.model_extra["slotkeeper"]["restored"]
                assert timings["cache_n"] > done.usage.prompt_tokens // 2
            msgs.append({"role": "assistant", "content": done.choices[0].message.content})
    metrics = {
        line.split()[0]: float(line.split()[1])
        for line in httpx.get(s.url + "/metrics").text.splitlines()
        if line and not line.startswith("#")
    }
    assert metrics["slotkeeper_gateway_evictions_total"] >= 4
    # After-turn tenants: every evicted session was already saved by its write-behind, never twice.
    assert metrics['slotkeeper_gateway_spill_bytes_total{why="after-turn"}'] > 0
    assert metrics.get('slotkeeper_gateway_spill_bytes_total{why="evict"}', 0) == 0
    assert metrics["slotkeeper_gateway_restores_reprefilled_total"] == 0
    assert metrics['slotkeeper_gateway_requests_total{path="/v1/chat/completions",status="200"}'] == 8
    node = httpx.get(s.node_url + "/metrics", headers=INTERNAL_AUTH).text
    assert 'slotkeeper_node_slot_operations_total{op="fill",outcome="ok"}' in node
    assert 'slotkeeper_node_engines{state="ready"} 1.0' in node


def _generation(url: str, session: str, headers: dict[str, str] | None = None) -> int:
    return int(httpx.get(f"{url}/v1/sessions/{session}", headers=headers).json().get("generation", 0))


def _wait_durable(url: str, session: str, above: int, headers: dict[str, str] | None = None) -> None:
    """Until the session's newest generation is above ``above`` (the one before the turn: a drain
    may have saved one more than there were turns)."""
    for _ in range(200):
        if _generation(url, session, headers) > above:
            return
        time.sleep(0.05)
    raise AssertionError(f"{session} never became durable past generation {above}")


def _wait_engine_restarted(s, old_pid: int) -> None:
    for _ in range(600):
        engines = s.engines()
        if engines[0]["state"] == "ready" and engines[0]["pid"] != old_pid:
            if httpx.get(s.url + "/ready").status_code == 200:
                return
        time.sleep(0.1)
    raise AssertionError(f"engine not restarted: {s.engines()}")


def test_ten_turns_with_everything_restarted_cost_what_an_uninterrupted_run_costs(serve, tmp_path: Path):
    """Between turns the engine is SIGKILLed (the pool restarts it; the session comes back from
    its after-turn save) or the whole serve process — gateway, node, engines — is restarted."""

    def conversation(restart: bool, data: Path) -> list[tuple[str, int, int]]:
        msgs = [{"role": "system", "content": SYSTEM}]
        out = []
        s = serve(data)
        for turn in range(10):
            msgs.append({"role": "user", "content": f"Step {turn}: list files, then run the tests."})
            before = _generation(s.url, "agent-1") if restart and turn else 0
            done, headers, timings = _turn(openai_client(s.url), msgs, session="agent-1")
            out.append((done.choices[0].message.content, timings["prompt_n"], timings["cache_n"]))
            msgs.append({"role": "assistant", "content": done.choices[0].message.content})
            if restart:
                assert headers["x-slotkeeper-cache"] == ("cold" if turn == 0 else "restored")
                _wait_durable(s.url, "agent-1", before)  # this turn's own save
                if turn % 2 == 0:
                    pid = s.engines()[0]["pid"]
                    os.kill(pid, signal.SIGKILL)
                    _wait_engine_restarted(s, pid)
                else:
                    assert s.stop(signal.SIGTERM) == 0  # drains: every live session spilled
                    s = serve(data)
        return out

    steady = conversation(False, tmp_path / "steady")
    restarted = conversation(True, tmp_path / "restarted")
    assert restarted == steady
    assert all(cache_n > 0 for _, _, cache_n in restarted[1:])


def test_tenants_are_isolated_and_delete_removes_everything(serve, tmp_path: Path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.a]\nkeys = ["key-a"]\n[tenants.b]\nkeys = ["key-b"]\n')
    data = tmp_path / "data"
    s = serve(data, tenants=tenants)
    with pytest.raises(openai.AuthenticationError):
        openai_client(s.url, "wrong").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}]
        )
    msgs = [{"role": "user", "content": "Hello from tenant A."}]
    done, headers, _ = _turn(openai_client(s.url, "key-a"), msgs)
    sid = headers["x-session-id"]
    msgs.append({"role": "assistant", "content": done.choices[0].message.content})
    msgs.append({"role": "user", "content": "again"})
    _, hb, _ = _turn(openai_client(s.url, "key-b"), msgs)  # B resends A's history: never A's session
    assert hb["x-session-id"] != sid
    b_auth = {"Authorization": "Bearer key-b"}
    a_auth = {"Authorization": "Bearer key-a"}
    assert httpx.get(f"{s.url}/v1/sessions/{sid}", headers=b_auth).status_code == 404
    assert httpx.delete(f"{s.url}/v1/sessions/{sid}", headers=b_auth).status_code == 404
    assert httpx.get(f"{s.url}/v1/sessions/{sid}", headers=a_auth).status_code == 200
    blobs = data / "blobs"
    _wait_durable(s.url, sid, 0, a_auth)  # its write-behind save
    assert any(p.name.endswith(".manifest") for p in blobs.rglob(f"*{sid}*/*"))
    assert httpx.delete(f"{s.url}/v1/sessions/{sid}", headers=a_auth).json()["deleted"] is True
    assert httpx.get(f"{s.url}/v1/sessions/{sid}", headers=a_auth).status_code == 404
    assert not any(blobs.rglob(f"*{sid}*/*"))  # manifests and tails


def test_bad_requests_get_openai_errors(serve, tmp_path: Path):
    s = serve(tmp_path / "data")
    client = openai_client(s.url)
    # One model and no tenants file: any name reaches it, as with llama-server (with a tenants file,
    # an unknown name is a 404: test_messages_routes, test_responses_routes).
    done = client.chat.completions.create(
        model="nope", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert done.choices[0].message is not None
    with pytest.raises(openai.BadRequestError, match="X-Session-Id"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], extra_headers={"X-Session-Id": "../etc"}
        )
    r = httpx.post(s.url + "/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def _a_saved_first_turn(s: Serve, client: openai.OpenAI, session: str, text: str) -> list[dict]:
    """The first turn of `session` (the system prompt, then `text`), answered and durable: its
    messages, the answer included."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
    done, _, _ = _turn(client, msgs, session=session)
    msgs.append({"role": "assistant", "content": done.choices[0].message.content})
    _wait_durable(s.url, session, 0)  # its write-behind save
    return msgs


def _long_stream(client: openai.OpenAI, msgs: list[dict], session: str) -> Any:
    """A greedy streamed answer in `session` that runs long (up to 1900 tokens, EOS ignored)."""
    return client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=1900,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Session-Id": session},
    )


def test_engine_killed_mid_stream_resumes_from_the_last_durable_turn(serve, tmp_path: Path):
    s = serve(tmp_path / "data", slots=1)
    client = openai_client(s.url)
    msgs = _a_saved_first_turn(s, client, "agent-9", "First step.")
    msgs.append({"role": "user", "content": "Second step, a long answer please."})
    pid = s.engines()[0]["pid"]
    stream = _long_stream(client, msgs, "agent-9")
    with pytest.raises(openai.APIError):
        for i, _chunk in enumerate(stream):
            if i == 0:
                os.kill(pid, 9)
    _wait_engine_restarted(s, pid)  # the supervisor restarts the engine
    done, headers, timings = _turn(client, msgs, session="agent-9")
    assert headers["x-slotkeeper-cache"] == "restored"
    assert done.model_extra["slotkeeper"]["restored"] and timings["cache_n"] > done.usage.prompt_tokens // 2


QUOTAS = (
    '[tenants.a]\nkeys = ["key-a"]\n[tenants.a.quotas]\nrequests_per_minute = 3\n'
    '[tenants.b]\nkeys = ["key-b"]\n[tenants.b.quotas]\nsessions = 1\n'
)


def test_quotas_answer_429_with_retry_after(serve, tmp_path: Path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(QUOTAS)
    s = serve(tmp_path / "data", tenants=tenants)
    msgs = [{"role": "user", "content": "hi"}]
    for _ in range(3):
        _turn(openai_client(s.url, "key-a"), msgs, session="one")
    auth = {"Authorization": "Bearer key-a", "X-Session-Id": "one"}
    body = {"model": MODEL, "messages": msgs, "max_tokens": 1}
    r = httpx.post(s.url + "/v1/chat/completions", headers=auth, json=body)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_error"
    _turn(openai_client(s.url, "key-b"), msgs, session="first")
    with pytest.raises(openai.RateLimitError, match="limit of 1 sessions"):
        _turn(openai_client(s.url, "key-b"), msgs, session="second")


def test_a_busy_session_is_forked_not_waited_for(serve, tmp_path: Path):
    s = serve(tmp_path / "data", slots=2)
    client = openai_client(s.url)
    msgs = _a_saved_first_turn(s, client, "main", "First.")
    long = _long_stream(client, msgs + [{"role": "user", "content": "Long."}], "main")
    next(iter(long))  # "main" is now busy generating
    done, headers, timings = _turn(client, msgs + [{"role": "user", "content": "Meanwhile?"}], session="main")
    assert headers["x-session-id"].startswith("main.f")
    # The fork starts from its parent's live slot on the same engine, as it stands mid-generation.
    assert headers["x-slotkeeper-cache"] == "prefix" and timings["cache_n"] > 0
    assert done.model_extra is not None and done.model_extra["slotkeeper"]["source_slot"] >= 0
    long.close()
    metrics = httpx.get(s.url + "/metrics").text
    reused = 'slotkeeper_gateway_tenant_prompt_tokens_total{kind="reused",served="prefix",tenant="default"}'
    assert reused in metrics


def test_legacy_completions_with_a_session_and_gateway_flag_checks(serve, tmp_path: Path):
    import subprocess
    import sys

    s = serve(tmp_path / "data")
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    first = httpx.post(s.url + "/v1/completions", json=body, headers={"X-Session-Id": "story"})
    assert first.status_code == 200 and first.headers["x-slotkeeper-cache"] == "cold"
    again = httpx.post(s.url + "/v1/completions", json=body, headers={"X-Session-Id": "story"})
    assert again.headers["x-slotkeeper-cache"] == "live"
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert again.json()["timings"]["prompt_n"] == 0  # identical prompt: served from stored logits
    gw = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "gateway", "--node", s.node_url],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert gw.returncode == 2 and "--redis-url, --s3-bucket required" in gw.stderr


def test_implicit_routing_survives_a_restart_of_the_in_process_index(serve, tmp_path: Path):
    """`serve` keeps its index in process; the routing digest travels with each slot file, so the
    reindex at start-up lets a resent history find its session again."""
    data = tmp_path / "data"
    s = serve(data)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "First step."}]
    done, headers, _ = _turn(openai_client(s.url), msgs)
    session = headers["x-session-id"]
    msgs.append({"role": "assistant", "content": done.choices[0].message.content})
    assert s.stop(signal.SIGTERM) == 0
    s = serve(data)
    msgs.append({"role": "user", "content": "Second step."})
    done, headers, timings = _turn(openai_client(s.url), msgs)
    assert headers["x-session-id"] == session
    assert headers["x-slotkeeper-cache"] == "restored" and timings["cache_n"] > 0


def test_input_tokens_counts_a_chat_without_running_it(serve, tmp_path: Path):
    s = serve(tmp_path / "data")
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Count me."}]
    counted = httpx.post(f"{s.url}/v1/chat/completions/input_tokens", json={"model": MODEL, "messages": msgs})
    assert counted.status_code == 200, counted.text
    done, _, _ = _turn(openai_client(s.url), msgs)
    assert counted.json()["input_tokens"] == done.usage.prompt_tokens
    assert httpx.get(f"{s.url}/v1/sessions").json()["data"][0]["tokens"] > 0  # only the real turn made one
    assert len(httpx.get(f"{s.url}/v1/sessions").json()["data"]) == 1


def _node_metric(s, name: str) -> float:
    for line in httpx.get(s.node_url + "/metrics", headers=INTERNAL_AUTH).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def test_an_edited_earlier_message_restores_only_up_to_where_it_diverges(serve, tmp_path: Path):
    """After a restart, a conversation whose second user message was edited restores the stored
    session only up to the checkpoint at that message's start (the node's "cut"): the turn reuses
    that much and evaluates the rest. (The engine-level equality with a whole restore, and the
    whole restore for a conversation that goes on from the end: tests/storage/chunks/test_prefixcut.py,
    tests/engine_pool/pool/test_agent.py.)"""
    s = serve(tmp_path / "data")
    client = openai_client(s.url)
    msgs = [{"role": "system", "content": SYSTEM}]
    for turn in range(3):
        msgs.append({"role": "user", "content": f"Step {turn}: open the failing test and explain it."})
        done, _, _ = _turn(client, msgs, session="agent-1")
        msgs.append({"role": "assistant", "content": done.choices[0].message.content})
        _wait_durable(s.url, "agent-1", turn)  # (saves of turns sent back to back coalesce)
    edited = [*msgs[:3], {"role": "user", "content": "Step 1, instead: revert the last change."}]
    assert s.stop(signal.SIGTERM) == 0  # drained: the session is in the store only
    s = serve(tmp_path / "data")
    client = openai_client(s.url)
    cut_metric = 'slotkeeper_node_slot_bytes_total{op="fill",source="cut"}'
    done, headers, timings = _turn(client, edited, session="agent-1")
    assert headers["x-slotkeeper-cache"] == "restored"
    assert _node_metric(s, cut_metric) > 0  # restored up to the edited message only

    # what the engine kept: the conversation before the edited message (the checkpoint at its start)
    def counted(messages: list[dict]) -> int:
        r = httpx.post(
            f"{s.url}/v1/chat/completions/input_tokens", json={"model": MODEL, "messages": messages}
        )
        return int(r.json()["input_tokens"])

    assert counted(msgs[:1]) < timings["cache_n"] < counted(msgs[:4])  # past the system, before the edit
    assert timings["prompt_n"] == done.usage.prompt_tokens - timings["cache_n"]


ONE_SMALL_SLOT = ("--slots", "1", "--ctx", "256")
CONSOLE = ("--log-format", "console")  # what a person at a terminal reads (stderr is a pipe here)


def _bad_model(kind: str, tmp_path: Path, tiny: bytes) -> tuple[str, str]:
    """A model file of `kind` (root reads any file, so `unreadable` is a FIFO: not a regular file) and
    what `serve` must say about it."""
    path = tmp_path / f"{kind}.gguf"
    if kind == "missing":
        return str(path), "does not exist"
    if kind == "directory":
        path.mkdir()
        return str(path), "is a directory, not a GGUF file"
    if kind == "unreadable":
        os.mkfifo(path)
        return str(path), "is not a regular file"
    if kind == "not-gguf":
        path.write_text("<!DOCTYPE html><title>Sign in to download</title>")
        return str(path), "is not a GGUF file (it starts with b'<!DO', not b'GGUF')"
    if kind == "truncated-header":
        path.write_bytes(tiny[:2000])
        where = "the value of 'tokenizer.ggml.tokens' runs past the end of its 2000 bytes"
        return str(path), f"has a truncated GGUF header ({where})"
    path.write_bytes(tiny[: len(tiny) // 2])  # truncated-data: an interrupted download
    return str(path), (
        f"is truncated: its tensors end at byte {len(tiny)}, the file has {len(tiny) // 2} bytes "
        "(an interrupted download?)"
    )


@pytest.mark.parametrize(
    "kind", ["missing", "directory", "unreadable", "not-gguf", "truncated-header", "truncated-data"]
)
def test_a_bad_model_stops_serve_at_once_saying_why(kind: str, tiny_model, tmp_path: Path) -> None:
    path, problem = _bad_model(kind, tmp_path, Path(tiny_model("llama")).read_bytes())
    t0 = time.monotonic()
    argv = serve_argv(path, tmp_path / "data", free_port(), free_port(), *ONE_SMALL_SLOT, *CONSOLE)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert time.monotonic() - t0 < 5
    assert done.returncode == 2
    assert done.stderr.splitlines() == [  # one line and its hint, no traceback
        f"slotkeeper serve: error: model {path}: {problem}",
        "  hint: pass --model with the path of a GGUF file (llama.cpp's format)",
    ]


def test_a_model_that_never_loads_is_given_up_and_models_says_why(tmp_path: Path) -> None:
    model = unloadable_model(tmp_path / "alien.gguf")
    port, node_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            serve_argv(model, tmp_path / "data", port, node_port, *ONE_SMALL_SLOT, "--keep-running"),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:

        def failed() -> dict | None:
            try:
                listed = httpx.get(url + "/v1/models", timeout=5).json()["data"]
            except httpx.HTTPError:  # not listening yet
                return None
            return next((m for m in listed if m.get("status") == "failed"), None)

        wait_until(failed, proc, "the model given up", timeout=120)
        entry = failed()
        assert entry is not None and entry["id"] == "alien"
        assert entry["error"].startswith("exited with code 1 while starting: the model failed to load: ")
        assert "unknown model architecture: 'notanarch'" in entry["error"]
        engine = httpx.get(f"http://127.0.0.1:{node_port}/v1/engines", headers=INTERNAL_AUTH).json()[
            "engines"
        ][0]
        assert engine["state"] == "failed" and engine["restarts"] == 2 and engine["error"] == entry["error"]
        # A chat for it says why it cannot be served, not "retry".
        hi = {"model": "alien", "messages": [{"role": "user", "content": "hi"}]}
        chat = httpx.post(url + "/v1/chat/completions", timeout=10, json=hi)
        assert chat.status_code == 503 and "retry-after" not in chat.headers, chat.text
        assert chat.json()["error"]["message"] == f"the model 'alien' failed to start: {entry['error']}"
        ready = httpx.get(url + "/ready", timeout=10)  # a probe, or a person, reads why
        assert ready.status_code == 503 and ready.json()["reason"] == f"local-e0 gave up: {entry['error']}"
    finally:
        code = Serve(url, proc, log).stop()
    assert code == 0
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    moves = [e for e in events if e.get("event") == "engine.transition"]
    # The console shows the engine's own words at every failed start, and gives up once.
    assert [e["to"] for e in moves if e["to"] in ("crashed", "failed")] == ["crashed", "crashed", "failed"]
    assert all(entry["error"] in e["reason"] for e in moves if e["to"] in ("crashed", "failed"))
    assert [e["reason"] for e in moves if e["to"] == "failed"] == [
        f"gave up after 3 failed starts in a row: {entry['error']}"
    ]
    levels = {e["to"]: e["level"] for e in moves}  # what stands out on a console
    assert (levels["starting"], levels["crashed"], levels["failed"]) == ("info", "warning", "error")


def test_serve_whose_every_engine_gave_up_exits_saying_why(tmp_path: Path) -> None:
    """One machine with no engine left serves nothing: serve ends with status 1, its last words the
    engine's own reason and what to do (--keep-running keeps it up: the test above)."""
    model = unloadable_model(tmp_path / "alien.gguf")
    argv = serve_argv(model, tmp_path / "data", free_port(), free_port(), *ONE_SMALL_SLOT, *CONSOLE)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    *_, error, hint = done.stderr.splitlines()
    assert error.startswith("slotkeeper serve: error: no engine is left, every one gave up: local-e0: ")
    assert "unknown model architecture: 'notanarch'" in error
    assert hint.startswith("  hint: ") and "--keep-running" in hint
    gave_up = [line for line in done.stderr.splitlines() if "to=failed" in line]
    assert len(gave_up) == 1 and "[error" in gave_up[0] and "hint=" in gave_up[0], gave_up
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("which", ["--port", "--node-port"])
def test_a_port_in_use_ends_serve_at_once_naming_the_flag(which: str, tiny_model, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = {"--port": free_port(), "--node-port": free_port(), which: busy}
        argv = serve_argv(
            tiny_model("llama"), tmp_path / "data", ports["--port"], ports["--node-port"], *CONSOLE
        )
        t0 = time.monotonic()
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert time.monotonic() - t0 < 10  # before any engine starts
        as_json = subprocess.run(argv[:-2], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and as_json.returncode == 3
    assert done.stderr.splitlines() == [
        f"slotkeeper serve: error: port {busy} on 127.0.0.1 is in use",
        f"  hint: pass {which} with a free port, or stop the process listening on {busy}",
    ]
    (event,) = [json.loads(line) for line in as_json.stderr.splitlines()]  # a log collector's one line
    assert event["level"] == "error" and event["event"] == "serve.start_failed" and event["exit_code"] == 3
    assert which in event["hint"] and str(busy) in event["error"]


def test_a_redis_serve_cannot_reach_ends_it_saying_why_and_stops_its_engines(
    tiny_model, tmp_path: Path
) -> None:
    """The gateway's start-up probe fails (nothing listens at the Redis URL): serve ends with status 3,
    the probe's cause and serve's own last words on the console, no traceback, and the engine the
    node had begun to start is stopped (the node shuts down with the gateway, not the process from
    inside a task)."""
    redis_url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    argv = serve_argv(
        tiny_model("llama"), tmp_path / "data", free_port(), free_port(), "--redis-url", redis_url, *CONSOLE
    )
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert any(line.startswith("slotkeeper gateway: cannot start: redis at 127.0.0.1:") for line in lines)
    assert lines[-2] == "slotkeeper serve: error: serve did not start (the error above says why)"
    assert "Traceback" not in done.stderr and "Task exception" not in done.stderr, done.stderr[-3000:]
    assert not _processes_naming(tmp_path / "data")  # no engine outlives it


def _processes_naming(path: Path) -> list[str]:
    """The command lines of the processes running now that name ``path``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # (not a process, or gone)
            continue
        if str(path) in cmdline:
            found.append(cmdline)
    return found


@pytest.mark.parametrize(
    ("flag", "value", "forms"),
    [
        ("--redis-url", "redis+cluster://10.0.0.1:7000", "redis://[[user]:password@]host[:port][/db]"),
        ("--redis-url", "localhost:6379", "unix:///path/redis.sock"),
        ("--s3-endpoint", "minio:9000", "an http:// or https:// URL"),
        ("--port", "http", "invalid value 'http'"),
    ],
)
def test_a_malformed_setting_names_the_flag_and_the_accepted_forms(
    flag: str, value: str, forms: str, tmp_path: Path
) -> None:
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--data-dir", str(tmp_path), flag, value, *CONSOLE]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    error, hint = done.stderr.splitlines()
    assert error.startswith(f"slotkeeper serve: error: {flag}") and forms in error and value in error
    assert hint == "  hint: see `slotkeeper serve --help`"


def test_help_puts_the_flags_people_need_first_and_names_every_default_and_variable() -> None:
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--help"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout
    options = out.split("\n\n", 2)[-1]
    flags = [line.split()[0].rstrip(",") for line in options.splitlines() if line.startswith("  --")]
    assert flags[:3] == ["--model", "--slots", "--ctx"], flags
    blocks = options.split("\n  --")[1:]
    assert blocks and all("[env SLOTKEEPER_" in " ".join(b.split()) for b in blocks), blocks
    for flag, default in (("--slots", "2"), ("--ctx", "8192"), ("--lock-ttl-s", "15.0")):
        block = next(b for b in blocks if b.startswith(flag[2:] + " "))
        assert default in block, block


def test_serve_reads_its_own_flags_from_the_environment(tiny_model: Any, tmp_path: Path) -> None:
    port, node_port = free_port(), free_port()
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--data-dir", str(tmp_path)]
    env = {**os.environ, "SLOTKEEPER_MODELS": tiny_model("llama"), "SLOTKEEPER_SLOTS": "3"}
    env.update(SLOTKEEPER_CTX="512", SLOTKEEPER_NODE_PORT=str(node_port))
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    s = Serve(f"http://127.0.0.1:{port}", proc, log, node_url=f"http://127.0.0.1:{node_port}")
    try:
        wait_ready(s.url, proc, log, timeout=90)
        engines = s.engines()
        assert [(e["n_slots"], e["model"]) for e in engines] == [(3, "llama-seed0")], engines
    finally:
        assert s.stop() == 0


def test_serve_works_from_a_directory_whose_packages_would_hide_the_install(
    tiny_model, tmp_path: Path
) -> None:
    """The repository root holds `native/` without its compiled module: an engine started there
    must still import the installed one (`python -P`). A stand-in tree that breaks every import of
    it proves the engines never look in the working directory."""
    for package in ("native", "gateway", "engine_pool", "storage"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(f"raise ImportError('the stand-in {package}/')\n")
    command = Path(sys.executable).with_name("slotkeeper")  # what the README runs (not `python -m`)
    port, node_port = free_port(), free_port()
    argv = [str(command), "serve", "--model", tiny_model("qwen35"), "--port", str(port)]
    argv += ["--node-port", str(node_port), "--data-dir", str(tmp_path / "data"), *ONE_SMALL_SLOT]
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    s = Serve(f"http://127.0.0.1:{port}", proc, log)
    try:
        wait_ready(s.url, proc, log, timeout=90)
        assert "the stand-in" not in log.read_text()
    finally:
        assert s.stop() == 0


def test_a_model_without_a_chat_template_is_served_with_a_warning_saying_how_to_give_one(
    tiny_model, tmp_path: Path
) -> None:
    """The ChatML fallback is announced on the console with the fix, serve's --chat-template takes
    it, and a plain reply's text is a string either way (never null)."""
    model = tmp_path / "untemplated.gguf"
    strip = [sys.executable, "-m", "gguf.scripts.gguf_new_metadata", tiny_model("qwen35"), str(model)]
    strip += ["--remove-metadata", "tokenizer.chat_template", "--force"]
    subprocess.run(strip, check=True, capture_output=True, stdin=subprocess.DEVNULL, timeout=60)
    hi = {"model": "m", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4}
    for extra, warned, origin in (
        ((), True, "chatml-fallback"),
        (("--chat-template", "chatml"), False, "builtin:chatml"),
    ):
        port, node_port = free_port(), free_port()
        argv = serve_argv(
            str(model), tmp_path / f"data-{port}", port, node_port, *ONE_SMALL_SLOT, *CONSOLE, *extra
        )
        log = tmp_path / f"serve-{port}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        s = Serve(f"http://127.0.0.1:{port}", proc, log)
        try:
            wait_ready(s.url, proc, log, timeout=90)
            r = httpx.post(s.url + "/v1/chat/completions", json=hi, timeout=60)
            assert r.status_code == 200, r.text
            assert isinstance(r.json()["choices"][0]["message"]["content"], str), r.text
            lines = log.read_text(errors="replace").splitlines()
        finally:
            assert s.stop() == 0
        warnings = [line for line in lines if "engine.chat_template_fallback" in line]
        assert bool(warnings) is warned, lines
        if warned:
            assert "[warning" in warnings[0] and "--chat-template-file PATH" in warnings[0]
            assert "the model has no chat template" in warnings[0]
        ready = [line for line in lines if "to=ready" in line]
        assert ready and f"chat_template={origin}" in ready[0], ready

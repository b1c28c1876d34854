"""The prefill/decode split through `slotkeeper serve` (gateway.turn.handoff): one node running a
prefill and a decode engine of the tiny qwen35, tenants with thresholds of 0 (always), off (never)
and the default (2048 uncached tokens).

A split turn's decode side evaluates 0 prompt tokens and answers exactly as an unsplit turn — a new
session's, and a live session's long new message (its state carried to the prefill engine and
back); its session then lives on the decode engine; a prefill engine that is gone, hung past
--handoff-timeout-s or of another model (its state refused) costs one unsplit turn, never an
error, and a client that leaves during the prefill cancels it there. Roles show in the node's
engine listing, the engines' /v1/models and the metrics. Across two nodes (a gateway and two node
agents, processes), the state goes node to node.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.bench.harness.servers import AWS_ENV, INTERNAL_AUTH, INTERNAL_KEY, free_port, stop

from .conftest import Serve, eventually, start_serve

MODEL = "qwen35-seed0"
TENANTS = """
[tenants.split]
keys = ["key-split"]
handoff_threshold = 0
[tenants.whole]
keys = ["key-whole"]
handoff_threshold = "off"
[tenants.usual]
keys = ["key-usual"]
[tenants.agent]
keys = ["key-agent"]
handoff_threshold = 300
"""
SYSTEM = "You are a careful assistant. Answer briefly and exactly. " * 6


def _start(prefill_model: str, decode_model: str, tmp_path: Path, *args: str) -> Serve:
    """serve with a prefill engine of ``prefill_model`` and a decode engine of ``decode_model``
    (one model id: the file name)."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    argv = ("--model", decode_model, "--role", "prefill", "--role", "decode", *args)
    log = tmp_path / "serve.log"
    s = start_serve(prefill_model, tmp_path / "data", log, slots=2, tenants=tenants, args=argv)
    # Ready once one engine is registered: wait for the other too.
    eventually("both engines ready", lambda: [e["state"] for e in s.engines()] == ["ready", "ready"], 60)
    probe = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    eventually(
        "the decode engine registered",
        lambda: (
            httpx.post(
                s.url + "/v1/chat/completions",
                json=probe,
                headers={"Authorization": "Bearer key-whole"},
                timeout=60,
            ).status_code
            == 200
        ),
        30,
    )
    return s


@pytest.fixture
def split_serve(tiny_model: Callable[..., str], tmp_path: Path) -> Iterator[Serve]:
    model = tiny_model("qwen35")
    # Early starts on (the default): a follow-up turn below that may be split is not sent early, even
    # when it arrives while its previous turn's hold is still kept (gateway.turn.opening).
    s = _start(model, model, tmp_path, "--handoff-timeout-s", "20")
    yield s
    s.stop(signal.SIGKILL, timeout=30)


def _chat(
    s: Serve, key: str, session: str, messages: list[dict[str, Any]], timeout: float = 120
) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0}
    headers = {"Authorization": f"Bearer {key}", "X-Session-Id": session}
    r = httpx.post(s.url + "/v1/chat/completions", json=body, headers=headers, timeout=timeout)
    assert r.status_code == 200, r.text
    return r


def _conversation(user: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def _text(r: httpx.Response) -> str:
    return str(r.json()["choices"][0]["message"]["content"])


def _metric(url: str, line: str, headers: dict[str, str] | None = None) -> float:
    text = httpx.get(url + "/metrics", timeout=10, headers=headers or {}).text
    found = [ln for ln in text.splitlines() if ln.startswith(line + " ")]
    return float(found[0].split()[-1]) if found else 0.0


def test_a_split_turn_evaluates_nothing_on_the_decode_side_and_answers_as_unsplit(split_serve: Serve) -> None:
    s = split_serve
    engines = s.engines()
    assert [e["role"] for e in engines] == ["prefill", "decode"]
    prefill, decode = engines
    models = httpx.get(decode["url"] + "/v1/models", headers=INTERNAL_AUTH, timeout=5).json()
    assert models["data"][0]["role"] == "decode"
    assert _metric(s.node_url, 'slotkeeper_node_engine_roles{role="prefill"}', INTERNAL_AUTH) == 1

    messages = _conversation("Tell me about the weather, the time and the place of the meeting.")
    whole = _chat(s, "key-whole", "w1", messages)  # never split: the decode engine prefills
    split = _chat(s, "key-split", "s1", messages)
    n_prompt = whole.json()["timings"]["prompt_n"]
    assert n_prompt == whole.json()["usage"]["prompt_tokens"] > 100
    assert whole.headers["X-Slotkeeper-Cache"] == "cold"
    assert split.headers["X-Slotkeeper-Cache"] == "handoff"
    assert split.json()["slotkeeper"]["served"] == "handoff"
    assert split.json()["timings"]["prompt_n"] == 0  # sampled from the handed logits
    assert split.json()["usage"]["prompt_tokens"] == n_prompt
    assert _text(split) == _text(whole) and _text(split)
    assert _metric(s.url, 'slotkeeper_gateway_handoffs_total{result="done"}') == 1
    assert _metric(s.url, "slotkeeper_gateway_handoff_bytes_total") > 0
    assert _metric(s.node_url, 'slotkeeper_node_handoffs_total{result="done"}', INTERNAL_AUTH) == 1

    # The session lives on the decode engine. Its next turn, with a threshold of 0, is split too: its
    # state goes to the prefill engine, which evaluates the new tokens only, and comes back.
    more = [{"role": "assistant", "content": _text(split)}, {"role": "user", "content": "And the day after?"}]
    follow = _chat(s, "key-split", "s1", [*messages, *more])
    assert follow.headers["X-Slotkeeper-Cache"] == "handoff"
    assert follow.json()["timings"]["prompt_n"] == 0
    assert _metric(s.url, 'slotkeeper_gateway_handoffs_total{result="done"}') == 2
    # Unsplit, the same turn of the never-split session evaluates the new tokens only: the same answer.
    again = _chat(s, "key-whole", "w1", [*messages, {"role": "assistant", "content": _text(whole)}, more[1]])
    assert again.headers["X-Slotkeeper-Cache"] == "live" and 0 < again.json()["timings"]["prompt_n"] < 40
    assert _text(again) == _text(follow)

    # The default threshold (2048 uncached tokens) leaves a short prompt where it is.
    usual = _chat(s, "key-usual", "u1", _conversation("Tell me about the weather, the time and the place."))
    assert usual.headers["X-Slotkeeper-Cache"] == "cold"


def test_a_prefill_engine_gone_costs_one_unsplit_turn(split_serve: Serve) -> None:
    s = split_serve
    prefill = s.engines()[0]
    os.kill(prefill["pid"], signal.SIGKILL)
    messages = _conversation("What is on the agenda of the meeting tomorrow morning?")
    r = _chat(s, "key-split", "s2", messages)
    assert r.headers["X-Slotkeeper-Cache"] == "cold"
    assert r.json()["timings"]["prompt_n"] == r.json()["usage"]["prompt_tokens"]
    assert _metric(s.url, 'slotkeeper_gateway_handoffs_total{result="done"}') == 0
    # (Its node may have unregistered it before the turn came — no handoff tried — or not: then the
    # handoff failed, counted by the reason.)
    failed = [
        _metric(s.url, f'slotkeeper_gateway_handoffs_total{{result="{x}"}}')
        for x in ("failed", "unavailable")
    ]
    assert sum(failed) <= 1
    # Restarted by its supervisor, it takes a later split turn again.
    eventually(
        "the prefill engine restarted",
        lambda: s.engines()[0]["state"] == "ready" and s.engines()[0]["pid"] != prefill["pid"],
        60,
    )
    n = iter(range(1000))

    def split_again() -> bool:
        body = {"model": MODEL, "messages": _conversation("Who comes?"), "max_tokens": 4, "temperature": 0}
        headers = {"Authorization": "Bearer key-split", "X-Session-Id": f"s-again-{next(n)}"}
        r = httpx.post(s.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
        # (503: both decode slots held by the last turns' saves a moment longer)
        assert r.status_code in (200, 503), r.text
        return r.status_code == 200 and r.headers["X-Slotkeeper-Cache"] == "handoff"

    eventually("a split turn after the restart", split_again, 30)


def _tool_output(n: int) -> str:
    return "\n".join(
        f"row {i}: sensor {i % 17} read {i * 7 % 101} at {i % 24:02d}:{i % 60:02d}" for i in range(n)
    )


@pytest.fixture
def long_split_serve(tiny_model: Callable[..., str], tmp_path: Path) -> Iterator[Serve]:
    """split_serve with room for prompts that take the tiny model seconds to prefill."""
    model = tiny_model("qwen35")
    s = _start(model, model, tmp_path, "--handoff-timeout-s", "60", "--ctx", "12288")
    yield s
    s.stop(signal.SIGKILL, timeout=30)


def test_a_prefill_engine_killed_mid_prompt_costs_one_unsplit_turn(long_split_serve: Serve) -> None:
    """The prefill engine dies while it evaluates a split turn's prompt: that turn is prefilled on
    the decode engine instead (200, the same answer), and a session living there goes on live."""
    s = long_split_serve
    before = _conversation("What is on the agenda of the meeting tomorrow morning?")
    kept = _chat(s, "key-split", "k0", before)
    assert kept.headers["X-Slotkeeper-Cache"] == "handoff"
    prefill = s.engines()[0]
    long = _conversation("The tool's output:\n" + _tool_output(300) + "\nWhat stands out?")
    answer: list[httpx.Response] = []
    turn = threading.Thread(target=lambda: answer.append(_chat(s, "key-split", "m1", long)))
    turn.start()

    def prefilling() -> bool:
        slots = httpx.get(prefill["url"] + "/slots", headers=INTERNAL_AUTH, timeout=5).json()
        return any(x["is_processing"] for x in slots)

    eventually("the prefill engine evaluating the prompt", prefilling, 30)
    os.kill(prefill["pid"], signal.SIGSTOP)  # (frozen mid-prompt, then killed)
    os.kill(prefill["pid"], signal.SIGKILL)
    turn.join(120)
    (r,) = answer
    assert r.headers["X-Slotkeeper-Cache"] != "handoff"
    assert r.json()["timings"]["prompt_n"] > 5000  # prefilled on the decode engine
    assert _metric(s.url, 'slotkeeper_gateway_handoffs_total{result="failed"}') == 1
    whole = _chat(s, "key-whole", "m2", long)  # the same prompt never split: the same answer
    assert _text(r) == _text(whole)
    more = [*before, {"role": "assistant", "content": _text(kept)}, {"role": "user", "content": "Why?"}]
    after = _chat(s, "key-split", "k0", more)
    assert after.headers["X-Slotkeeper-Cache"] in ("live", "handoff")


def test_a_long_tool_output_on_a_live_session_is_prefilled_on_the_prefill_engine(split_serve: Serve) -> None:
    """What agents send: a running session, then a long tool output. Its first turn is short (under
    the tenant's threshold of 300 uncached tokens: unsplit); its second adds ~1,000 tokens to the
    live session: the session's state goes to the prefill engine, the tail is prefilled there, and
    the decode engine evaluates nothing — the same answer as the same session never split."""
    s = split_serve
    first = _conversation("Fetch the sensor table and tell me what stands out.")
    answers = {key: _chat(s, key, f"{key}-1", first) for key in ("key-agent", "key-whole")}
    assert answers["key-agent"].headers["X-Slotkeeper-Cache"] == "cold"  # short: under the threshold
    turn2 = {
        key: [
            *first,
            {"role": "assistant", "content": _text(answers[key])},
            {"role": "user", "content": "The tool's output:\n" + _tool_output(40)},
        ]
        for key in answers
    }
    whole = _chat(s, "key-whole", "key-whole-1", turn2["key-whole"])
    assert whole.headers["X-Slotkeeper-Cache"] == "live"
    tail = whole.json()["timings"]["prompt_n"]
    assert tail > 300 and whole.json()["timings"]["cache_n"] > 100
    split = _chat(s, "key-agent", "key-agent-1", turn2["key-agent"])
    assert split.headers["X-Slotkeeper-Cache"] == "handoff"
    assert split.json()["timings"]["prompt_n"] == 0
    assert split.json()["usage"]["prompt_tokens"] == whole.json()["usage"]["prompt_tokens"]
    assert _text(split) == _text(whole)
    assert _metric(s.url, 'slotkeeper_gateway_handoffs_total{result="done"}') == 1


def test_a_turn_that_may_be_split_is_not_sent_early(tiny_model: Callable[..., str], tmp_path: Path) -> None:
    """Saves wait 10 s after each answer, so this gateway still holds the session when its next turn
    comes: a short follow-up goes early (beside its opening read) and unsplit; a long tool output
    right after it does not go early, and is split."""
    model = tiny_model("qwen35")
    s = _start(model, model, tmp_path, "--save-grace-s", "10")
    try:
        conversation = _conversation("Fetch the sensor table and tell me what stands out.")
        first = _chat(s, "key-agent", "e1", conversation)
        conversation += [
            {"role": "assistant", "content": _text(first)},
            {"role": "user", "content": "Fetch it, please."},
        ]
        short = _chat(s, "key-agent", "e1", conversation)
        assert short.headers["X-Slotkeeper-Cache"] == "live"
        assert _metric(s.url, 'slotkeeper_gateway_early_starts_total{outcome="answered"}') == 1
        conversation += [
            {"role": "assistant", "content": _text(short)},
            {"role": "user", "content": "The tool's output:\n" + _tool_output(40)},
        ]
        long = _chat(s, "key-agent", "e1", conversation)
        assert long.headers["X-Slotkeeper-Cache"] == "handoff"
        assert long.json()["timings"]["prompt_n"] == 0
        assert _metric(s.url, 'slotkeeper_gateway_early_starts_total{outcome="answered"}') == 1
    finally:
        s.stop(signal.SIGKILL, timeout=30)


def test_a_hung_prefill_engine_costs_one_turn_its_bound(
    tiny_model: Callable[..., str], tmp_path: Path
) -> None:
    model = tiny_model("qwen35")
    s = _start(model, model, tmp_path, "--handoff-timeout-s", "1")
    try:
        prefill = s.engines()[0]
        os.kill(prefill["pid"], signal.SIGSTOP)  # alive, answering nothing
        try:
            r = _chat(s, "key-split", "h1", _conversation("Who comes to the meeting?"))
        finally:
            os.kill(prefill["pid"], signal.SIGCONT)
        assert r.headers["X-Slotkeeper-Cache"] == "cold"
        assert r.json()["timings"]["prompt_n"] == r.json()["usage"]["prompt_tokens"]
        assert _metric(s.url, 'slotkeeper_gateway_handoffs_total{result="unavailable"}') == 1
        eventually(  # the prefill engine, running again, takes the next split turn
            "a split turn after the hang",
            lambda: (
                _chat(s, "key-split", f"h2-{time.monotonic()}", _conversation("Who?")).headers[
                    "X-Slotkeeper-Cache"
                ]
                == "handoff"
            ),
            30,
        )
    finally:
        s.stop(signal.SIGKILL, timeout=30)


def test_a_client_that_leaves_during_the_prefill_cancels_it_there(
    tiny_model: Callable[..., str], tmp_path: Path
) -> None:
    model = tiny_model("qwen35")
    s = _start(model, model, tmp_path)
    try:
        prefill = s.engines()[0]
        os.kill(prefill["pid"], signal.SIGSTOP)  # the prefill lasts until the client is gone
        try:
            with pytest.raises(httpx.ReadTimeout):
                _chat(s, "key-split", "c1", _conversation("Who comes to the meeting?"), timeout=1.5)
            eventually(
                "the node cancelled the handoff",
                lambda: (
                    _metric(s.node_url, 'slotkeeper_node_handoffs_total{result="cancelled"}', INTERNAL_AUTH)
                    == 1
                ),
                20,
            )
        finally:
            os.kill(prefill["pid"], signal.SIGCONT)
        slots = httpx.get(prefill["url"] + "/slots", headers=INTERNAL_AUTH, timeout=5).json()
        eventually(  # the engine saw its client (the node) go: nothing runs there
            "the prefill engine idle",
            lambda: (
                not any(
                    x["is_processing"]
                    for x in httpx.get(prefill["url"] + "/slots", headers=INTERNAL_AUTH, timeout=5).json()
                )
            ),
            20,
        )
        assert len(slots) == 2
        assert _metric(s.url, 'slotkeeper_gateway_handoffs_total{result="done"}') == 0
    finally:
        s.stop(signal.SIGKILL, timeout=30)


def test_a_state_the_decode_engine_refuses_costs_one_unsplit_turn(
    tiny_model: Callable[..., str], tmp_path: Path
) -> None:
    """The prefill engine serves another model under the same id (another file of the same name):
    its state fails the decode engine's fingerprint check, and the turn is prefilled there,
    the same answer as never split."""
    model = tiny_model("qwen35")
    other = tmp_path / "other" / Path(model).name
    other.parent.mkdir()
    shutil.copyfile(tiny_model("qwen35", seed=1), other)
    s = _start(str(other), model, tmp_path)
    try:
        messages = _conversation("What is on the agenda of the meeting tomorrow morning?")
        whole = _chat(s, "key-whole", "w1", messages)
        r = _chat(s, "key-split", "r1", messages)
        assert r.headers["X-Slotkeeper-Cache"] == "cold"
        assert r.json()["timings"]["prompt_n"] == r.json()["usage"]["prompt_tokens"]
        assert _text(r) == _text(whole)
        assert _metric(s.url, 'slotkeeper_gateway_handoffs_total{result="refused"}') == 1
        # The session goes on from the state its turn left in its slot.
        follow = _chat(
            s,
            "key-split",
            "r1",
            [*messages, {"role": "assistant", "content": _text(r)}, {"role": "user", "content": "Why?"}],
        )
        assert follow.headers["X-Slotkeeper-Cache"] in ("live", "handoff")
    finally:
        s.stop(signal.SIGKILL, timeout=30)


def test_a_turn_is_split_across_two_nodes_and_a_peer_gone_costs_one_unsplit_turn(
    tiny_model: Callable[..., str], redis_port: int, moto_server: Any, tmp_path: Path
) -> None:
    """A gateway and two node agents (processes, the internal credential on every call): n1 runs
    the prefill engine, n2 the decode engine. A new session's turn and its carried follow-up are
    prefilled on n1, their state sent node to node and installed on n2: 0 prompt tokens there, the
    answers of the never-split session. With n1 killed, a split turn runs unsplit on n2."""
    model, prefix = tiny_model("qwen35"), f"x{uuid.uuid4().hex[:8]}"
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    common = [
        *("--redis-url", f"redis://127.0.0.1:{redis_port}", "--redis-prefix", prefix),
        *("--s3-endpoint", moto_server.endpoint, "--s3-bucket", "slots", "--s3-prefix", prefix),
        *("--log-level", "info"),
    ]
    env = {**os.environ, **AWS_ENV, "SLOTKEEPER_INTERNAL_KEY": INTERNAL_KEY}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    urls: dict[str, str] = {}

    def launch(name: str, argv: list[str]) -> None:
        with (tmp_path / f"{name}.log").open("wb") as out:
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "gateway.cli", *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )

    try:
        for name, role in (("n1", "prefill"), ("n2", "decode")):
            port = free_port()
            urls[name] = f"http://127.0.0.1:{port}"
            launch(
                name,
                [
                    *("node", "--model", model, "--role", role, "--slots", "2", "--ctx", "2048"),
                    *("--port", str(port), "--node-id", name, "--data-dir", str(tmp_path / name)),
                    "--engine-arg=-t",
                    "--engine-arg=1",
                    *common,
                ],
            )
        port = free_port()
        s = Serve(f"http://127.0.0.1:{port}", procs["n1"], tmp_path / "gateway.log", node_url=urls["n2"])
        launch(
            "gateway",
            [
                *("gateway", "--port", str(port), "--data-dir", str(tmp_path / "gw")),
                *("--node", urls["n1"], "--node", urls["n2"], "--tenants", str(tenants)),
                *("--handoff-timeout-s", "20", *common),
            ],
        )

        probes = itertools.count()

        def splits() -> bool:
            """A new probe session's turn is split: the gateway answers and lists n1's prefill
            engine (a registry read before n1's engine was ready holds until a TTL ends)."""
            try:
                probe = _chat(s, "key-split", f"probe-{next(probes)}", [{"role": "user", "content": "Hi"}])
                return probe.headers["X-Slotkeeper-Cache"] == "handoff"
            except (httpx.TransportError, AssertionError):
                return False

        eventually("the gateway splitting turns over both nodes' engines", splits, 120)
        counted = {  # what the probes counted: the turns below are counted from here
            "done": _metric(s.url, 'slotkeeper_gateway_handoffs_total{result="done"}'),
            "failed": _metric(s.url, 'slotkeeper_gateway_handoffs_total{result="failed"}'),
            "peer": _metric(urls["n1"], 'slotkeeper_node_peer_prefills_total{result="done"}', INTERNAL_AUTH),
            "n2": _metric(urls["n2"], 'slotkeeper_node_handoffs_total{result="done"}', INTERNAL_AUTH),
            "n2 failed": _metric(
                urls["n2"], 'slotkeeper_node_handoffs_total{result="failed"}', INTERNAL_AUTH
            ),
        }
        messages = _conversation("Tell me about the weather, the time and the place of the meeting.")
        whole = _chat(s, "key-whole", "w1", messages)
        split = _chat(s, "key-split", "s1", messages)
        assert split.headers["X-Slotkeeper-Cache"] == "handoff"
        assert split.json()["timings"]["prompt_n"] == 0
        assert _text(split) == _text(whole) and _text(split)
        more = [
            {"role": "assistant", "content": _text(split)},
            {"role": "user", "content": "And the day after?"},
        ]
        follow = _chat(s, "key-split", "s1", [*messages, *more])  # its state carried to n1 and back
        assert follow.headers["X-Slotkeeper-Cache"] == "handoff"
        assert follow.json()["timings"]["prompt_n"] == 0
        again = _chat(
            s, "key-whole", "w1", [*messages, {"role": "assistant", "content": _text(whole)}, more[1]]
        )
        assert _text(again) == _text(follow)
        assert _metric(s.url, 'slotkeeper_gateway_handoffs_total{result="done"}') == counted["done"] + 2
        peer = _metric(urls["n1"], 'slotkeeper_node_peer_prefills_total{result="done"}', INTERNAL_AUTH)
        assert peer == counted["peer"] + 2
        assert (
            _metric(urls["n2"], 'slotkeeper_node_handoffs_total{result="done"}', INTERNAL_AUTH)
            == counted["n2"] + 2
        )

        procs["n1"].kill()  # the prefill engine's node gone: one unsplit turn, never an error
        procs["n1"].wait(10)
        r = _chat(s, "key-split", "s2", _conversation("What is on the agenda of the meeting tomorrow?"))
        assert r.headers["X-Slotkeeper-Cache"] in ("cold", "prefix")  # (the system prompt is live on n2)
        assert r.json()["timings"]["prompt_n"] > 0  # prefilled on the decode engine
        # n1's engine still listed (its registration has not lapsed): tried, failed at once.
        assert _metric(s.url, 'slotkeeper_gateway_handoffs_total{result="failed"}') == counted["failed"] + 1
        n2_failed = _metric(urls["n2"], 'slotkeeper_node_handoffs_total{result="failed"}', INTERNAL_AUTH)
        assert n2_failed == counted["n2 failed"] + 1
    finally:
        for proc in procs.values():
            stop(proc, signal.SIGKILL)

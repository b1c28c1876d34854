"""Two nodes, one stateless gateway, a real redis-server and a real S3 server (moto): a session
survives its node's SIGTERM (restored on the other node from S3) and a Redis flush (reindex)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import agents
import httpx
import openai
import pytest
from support.weather_agent import weather_agent

from engine_pool.protocol.node import NodeEngine
from gateway.bench.harness.servers import free_port, stop, wait_until
from gateway.cluster import failed_models

from .conftest import AGENT_SYSTEM, add_tool_result, read_file_turn

MODEL = "qwen35-seed0"
ENV = {
    **os.environ,
    "AWS_ACCESS_KEY_ID": "test",
    "AWS_SECRET_ACCESS_KEY": "test",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class Proc:
    def __init__(self, name: str, cmd: list[str], log: Path, url: str) -> None:
        self.name, self.url, self.log, self.cmd = name, url, log, cmd
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=ENV
            )

    def wait_ready(self, path: str) -> None:
        def ok() -> bool:
            try:
                return httpx.get(self.url + path, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_until(ok, self.proc, self.name, timeout=90)
        except RuntimeError:
            raise RuntimeError(f"{self.name}:\n{self.log.read_text()[-3000:]}") from None


@pytest.fixture
def cluster(tiny_model, redis_topology, moto_server, tmp_path: Path) -> Iterator[dict]:
    """Two nodes and a gateway on one primary, on a Redis Cluster and behind Sentinel."""
    prefix = f"c{uuid.uuid4().hex[:8]}"
    redis_url = redis_topology.url
    s3 = ["--s3-endpoint", moto_server.endpoint, "--s3-bucket", "slots", "--s3-prefix", prefix]
    common = ["--redis-url", redis_url, "--redis-prefix", prefix, *s3]
    procs: list[Proc] = []
    nodes = {}
    for name in ("n1", "n2"):
        port = free_port()
        cmd = [
            *(sys.executable, "-m", "gateway.cli", "node"),
            *("--model", tiny_model("qwen35")),
            *("--slots", "2"),
            *("--ctx", "2048"),
            *("--port", str(port)),
            *("--node-id", name),
            *("--data-dir", str(tmp_path / name)),
            *("--log-level", "warning"),
            *("--store-compression", "auto"),
            *common,
        ]
        p = Proc(name, cmd, tmp_path / f"{name}.log", f"http://127.0.0.1:{port}")
        procs.append(p)
        nodes[name] = p
    gw_port = free_port()
    gw_cmd = [
        *(sys.executable, "-m", "gateway.cli", "gateway"),
        *("--port", str(gw_port)),
        *("--data-dir", str(tmp_path / "gw")),
        *("--log-level", "warning"),
        *common,
        *[a for p in procs for a in ("--node", p.url)],
    ]
    gw = Proc("gateway", gw_cmd, tmp_path / "gateway.log", f"http://127.0.0.1:{gw_port}")
    procs.append(gw)
    try:
        for p in procs:
            p.wait_ready("/health")
        deadline = time.monotonic() + 60
        while httpx.get(gw.url + "/ready").json()["engines"] < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        yield {
            "gateway": gw,
            "nodes": nodes,
            "redis_url": redis_url,
            "flush": redis_topology.flush,
            "prefix": prefix,
            "s3": s3,
            "bucket": moto_server.client(),
        }
    finally:
        for p in procs:
            stop(p.proc, signal.SIGKILL)


@pytest.fixture
def procs_to_stop() -> Iterator[list[Proc]]:
    """Processes a test starts itself (a restarted node), SIGKILLed at its end."""
    started: list[Proc] = []
    yield started
    for p in started:
        stop(p.proc, signal.SIGKILL)


def _turn(url: str, messages: list[dict], session: str):
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=2, timeout=60) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            temperature=0,
            extra_headers={"X-Session-Id": session},
        )
        done = raw.parse()
    return done, raw.headers, done.model_extra["timings"]


def _node_of(gw_url: str, session: str) -> str:
    rec = httpx.get(f"{gw_url}/v1/sessions/{session}").json()
    return str(rec["engine"]).rsplit("-e", 1)[0]


def test_node_sigterm_moves_sessions_and_redis_flush_is_reindexed(cluster):
    gw = cluster["gateway"]
    msgs = [{"role": "system", "content": AGENT_SYSTEM}]
    for turn in range(2):
        msgs.append({"role": "user", "content": f"Step {turn}: run the tests."})
        done, headers, _ = _turn(gw.url, msgs, "agent-7")
        msgs.append({"role": "assistant", "content": done.choices[0].message.content})
    home = _node_of(gw.url, "agent-7")
    node = cluster["nodes"][home]
    node.proc.send_signal(signal.SIGTERM)  # drains: spills agent-7 to S3, exits
    assert node.proc.wait(60) == 0, node.log.read_text()[-2000:]
    rec = httpx.get(f"{gw.url}/v1/sessions/agent-7").json()
    # (turn 0's write-behind save gave way to turn 1, sent at once: its save, or the drain's, is it)
    assert rec["state"] == "spilled" and rec["generation"] >= 1
    s3 = cluster["bucket"]
    listed = s3.list_objects_v2(Bucket="slots", Prefix=cluster["prefix"] + "/")["Contents"]
    states = [o["Key"] for o in listed if o["Key"].endswith((".ck", ".tail"))]
    # told `auto`, the nodes store recurrent states compressed in S3 (storage.chunks.codec), restored below
    assert states and all(s3.get_object(Bucket="slots", Key=k)["Body"].read(4) == b"SKZ1" for k in states)

    msgs.append({"role": "user", "content": "Step 2: and now?"})
    done, headers, timings = _turn(gw.url, msgs, "agent-7")
    assert headers["x-slotkeeper-cache"] == "restored"
    assert _node_of(gw.url, "agent-7") != home
    assert done.model_extra["slotkeeper"]["restored"] and timings["cache_n"] > done.usage.prompt_tokens // 2
    msgs.append({"role": "assistant", "content": done.choices[0].message.content})

    # Redis loses everything; storage is the source of truth.
    cluster["flush"]()
    reindex = [sys.executable, "-m", "gateway.cli", "reindex", "--redis-url", cluster["redis_url"]]
    reindex += ["--redis-prefix", cluster["prefix"], *cluster["s3"]]
    rc = subprocess.run(reindex, env=ENV, capture_output=True, text=True, timeout=60)
    assert rc.returncode == 0, rc.stdout + rc.stderr
    # Stored (the hand-run reindex), or live in its slot: the gateway noticed the loss itself and
    # found the session in the slot its last turn ran in (gateway.healing), whichever came first.
    assert httpx.get(f"{gw.url}/v1/sessions/agent-7").json()["state"] in ("spilled", "live")
    deadline = time.monotonic() + 30  # the surviving node re-registers its engine on its next heartbeat
    while httpx.get(gw.url + "/ready").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.3)
    msgs.append({"role": "user", "content": "Step 3: finish."})
    done, headers, timings = _turn(gw.url, msgs, "agent-7")
    assert headers["x-slotkeeper-cache"] in ("restored", "live") and timings["cache_n"] > 0


def test_agent_apis_continue_on_another_node(cluster, procs_to_stop):
    """A Responses chain and an Anthropic tool round trip: the home node is drained between turns,
    the next turn lands on the other node and reuses the restored state."""
    import anthropic

    gw = cluster["gateway"]
    with openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=2, timeout=60) as client:
        raw = client.responses.with_raw_response.create(
            model="gpt-5",
            instructions=AGENT_SYSTEM,
            input="Step 1: list files.",
            max_output_tokens=8,
            temperature=0,
        )
        first, session = raw.parse(), raw.headers["x-session-id"]
    with anthropic.Anthropic(base_url=gw.url, api_key="none", max_retries=2, timeout=60) as claude:
        msgs: list[dict] = [{"role": "user", "content": "Open the README."}]
        raw_a = read_file_turn(claude, msgs, forced=True)
        use, a_session = raw_a.parse(), raw_a.headers["x-session-id"]

    def drain(name: str) -> None:
        node = cluster["nodes"][name]
        node.proc.send_signal(signal.SIGTERM)  # spills its sessions to S3, exits
        assert node.proc.wait(60) == 0, node.log.read_text()[-2000:]

    home = _node_of(gw.url, session)
    drain(home)
    with openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=2, timeout=60) as client:
        raw = client.responses.with_raw_response.create(
            model="gpt-5",
            instructions=AGENT_SYSTEM,
            input="Step 2: run tests.",
            previous_response_id=first.id,
            max_output_tokens=8,
            temperature=0,
        )
        second = raw.parse()
    assert raw.headers["x-session-id"] == session and raw.headers["x-slotkeeper-cache"] == "restored"
    assert _node_of(gw.url, session) != home
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens

    # Bring the drained node back, drain the other: the Anthropic session moves too.
    back = cluster["nodes"][home]
    cluster["nodes"][home] = Proc(home, back.cmd, back.log.with_suffix(".2.log"), back.url)
    procs_to_stop.append(cluster["nodes"][home])
    cluster["nodes"][home].wait_ready("/health")
    deadline = time.monotonic() + 60
    while httpx.get(gw.url + "/ready").json()["engines"] < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    a_home = _node_of(gw.url, a_session)
    drain(a_home)
    add_tool_result(msgs, use, "ok")
    with anthropic.Anthropic(base_url=gw.url, api_key="none", max_retries=2, timeout=60) as claude:
        raw_b = read_file_turn(claude, msgs, forced=False)
        follow = raw_b.parse()
    assert raw_b.headers["x-session-id"] == a_session and raw_b.headers["x-slotkeeper-cache"] == "restored"
    assert _node_of(gw.url, a_session) != a_home
    total = use.usage.input_tokens + (use.usage.cache_read_input_tokens or 0)
    assert (follow.usage.cache_read_input_tokens or 0) >= total

    # The Agents SDK continues the Responses chain there too (its session now restored on the other
    # node once more): its tool runs and the run completes.
    async def run_agent() -> tuple[str, list[str]]:
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=2) as client:
            agent, cities = weather_agent(client, "gpt-5", AGENT_SYSTEM)
            result = await agents.Runner.run(agent, "Weather?", max_turns=2, previous_response_id=second.id)
            return str(result.final_output), cities

    final, cities = asyncio.run(run_agent())
    assert final == "sunny" and len(cities) == 1


def _listed(**fields: object) -> NodeEngine:
    """An engine as a node's /v1/engines lists it, with `fields` over a stopped one's."""
    return NodeEngine.from_json({"id": "", "url": None, "n_slots": 1, "restarts": 0, "pid": None, **fields})


def test_a_model_is_failed_only_when_every_engine_of_it_was_given_up() -> None:
    engines = [
        _listed(model="alien", state="failed", error="exited with code 1 while starting: no arch"),
        _listed(model="alien", state="failed", error="exited with code 1 while starting: no arch"),
        _listed(model="qwen", state="failed", error="not healthy within 120 s"),
        _listed(model="qwen", state="starting", error=""),  # still trying on another node
        _listed(model="llama", state="ready"),
        _listed(model="old", state="failed", last_error="model /m.gguf: does not exist\nlast output:\n…"),
    ]
    assert failed_models(engines) == {
        "alien": "exited with code 1 while starting: no arch",
        "old": "model /m.gguf: does not exist",
    }


def test_not_ready_reason_says_why_no_engine_serves() -> None:
    """What /ready answers with its 503: an engine's own reason for giving up, states otherwise."""
    from gateway.cluster import not_ready_reason

    gave_up = _listed(id="n-e0", model="m", state="failed", error="the model failed to load: x")
    starting = _listed(id="n-e1", model="m2", state="starting")
    crashed = _listed(id="n-e2", model="m3", state="crashed", last_error="exited with code 1\nlog...")
    assert not_ready_reason([gave_up], True, 1) == "n-e0 gave up: the model failed to load: x"
    assert not_ready_reason([starting, crashed], True, 1) == (
        "n-e1 is starting; n-e2 crashed (exited with code 1), restarting"
    )
    assert not_ready_reason([], False, 2) == "no node agent answered (of 2 configured): are they running?"
    assert not_ready_reason([], True, 1) == "the node agents run no engine"
    assert not_ready_reason([starting], False, 2).endswith("; a node agent did not answer")

"""Partitions and slow links, for real: a gateway, two nodes, Redis and S3 each on a test host of its
own (a network namespace on one bridge, support.netns), the test's client outside them all.

- A node cut off for 30 s while its sessions are active: the gateway routes around it (its
  registrations lapse), every session goes on with its stored state on the other node, no session is
  ever placed twice, and when the node returns the sessions keep reusing their state.
- The store behind a link with 50 ms each way and 2 % loss (a relay: this kernel has no netem,
  gateway.bench.harness.slow_link): turns succeed and saves catch up.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import netns

from gateway.bench.harness.servers import (
    AWS_ENV,
    INTERNAL_AUTH,
    INTERNAL_KEY,
    MotoProcess,
    RedisProcess,
    eventually,
)
from gateway.bench.harness.slow_link import SlowLink

MODEL = "qwen35-seed0"
SYSTEM = "You are a coding agent. Read files, run tests, fix bugs, and report briefly. " * 4
PREFIX = "parts"
CUT_S = 30.0
HEARTBEAT_TTL_S = 6

why_not = netns.available()
if why_not and os.environ.get("CI"):
    raise RuntimeError(f"the partition tests need network namespaces here: {why_not}")
pytestmark = pytest.mark.skipif(why_not is not None, reason=why_not or "")


@dataclass
class Cluster:
    lab: netns.Lab
    gateway: str  # the gateway's URL, from the test's own namespace
    store_link: SlowLink
    moto: MotoProcess
    logs: Path


def _node(lab: netns.Lab, name: str, model: str, redis: str, store: str, logs: Path, *extra: str) -> str:
    host = lab.host(name)
    data = logs / name
    data.mkdir()
    host.popen(
        [
            *(sys.executable, "-m", "gateway.cli", "node"),
            *("--model", model, "--slots", "2", "--ctx", "2048"),
            *("--host", host.address, "--port", "8070", "--engine-host", host.address),
            *("--node-id", name, "--data-dir", str(data)),
            *("--redis-url", redis, "--redis-prefix", PREFIX),
            *("--s3-endpoint", store, "--s3-bucket", "slots", "--s3-prefix", PREFIX),
            *("--heartbeat-ttl", str(HEARTBEAT_TTL_S), "--flush-interval", "1", "--spill-bytes", "0"),
            *("--engine-arg=-t", "--engine-arg=1", "--log-level", "info"),
            *extra,
        ],
        logs / f"{name}.log",
        env={**AWS_ENV, "SLOTKEEPER_INTERNAL_KEY": INTERNAL_KEY},
    )
    return f"http://{host.address}:8070"


def _backends(lab: netns.Lab, logs: Path) -> tuple[RedisProcess, MotoProcess]:
    """redis-server and moto's S3 server, each on a host of its own ("redis", "s3")."""
    redis_host, s3_host = lab.host("redis"), lab.host("s3")
    redis = RedisProcess(logs, port=6379, host=redis_host.address)
    redis.start(launch=redis_host.popen)
    moto = MotoProcess(logs, port=5000, host=s3_host.address)
    moto.start(launch=s3_host.popen)
    return redis, moto


def _show_logs(logs: Path) -> None:
    """Every process's last lines, for a test that failed."""
    for log in sorted(logs.glob("*.log")):
        print(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}")


def _gateway(lab: netns.Lab, nodes: list[str], redis: str, store: str, logs: Path, *extra: str) -> str:
    """A gateway on host "gw" in front of ``nodes``; its URL."""
    gw = lab.host("gw")
    gw.popen(
        [
            *(sys.executable, "-m", "gateway.cli", "gateway"),
            *("--host", gw.address, "--port", "8080"),
            *[a for url in nodes for a in ("--node", url)],
            *("--redis-url", redis, "--redis-prefix", PREFIX),
            *("--s3-endpoint", store, "--s3-bucket", "slots", "--s3-prefix", PREFIX),
            *("--log-level", "info", *extra),
        ],
        logs / "gateway.log",
        env={**AWS_ENV, "SLOTKEEPER_INTERNAL_KEY": INTERNAL_KEY},
    )
    return f"http://{gw.address}:8080"


@pytest.fixture(scope="module")
def cluster(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("partitions")
    model = tiny_model("qwen35")
    with netns.lab() as lab:
        redis, moto = _backends(lab, logs)
        # The nodes reach the store through a link the test can slow down (on the bridge's address).
        link = SlowLink((lab.address, 0), (moto.host, moto.port))
        store = f"http://{lab.address}:{link.port}"
        nodes = [_node(lab, name, model, redis.url, store, logs) for name in ("n1", "n2")]
        url = _gateway(lab, nodes, redis.url, store, logs)

        def ready() -> bool:
            try:
                for node in nodes:
                    got = httpx.get(node + "/v1/engines", headers=INTERNAL_AUTH, timeout=2)
                    listed = got.json()["engines"]
                    if not listed or listed[0]["state"] != "ready":
                        return False
                return httpx.get(url + "/ready", timeout=2).status_code == 200
            except httpx.TransportError:  # not listening yet
                return False

        try:
            eventually("the gateway ready with both nodes' engines", ready, timeout_s=120)
            yield Cluster(lab, url, link, moto, logs)
        except BaseException:
            _show_logs(logs)
            raise
        finally:
            link.close()


class Agent:
    def __init__(self, url: str, session: str) -> None:
        self.url, self.session = url, session
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM + f" ({session})"}]
        self.served: list[tuple[int, str, int, int]] = []  # status, cache, reused, prompt tokens

    def turn(self, deadline: float = 0.0) -> httpx.Response:
        """The next user message, sent again on 503 (as the agents' clients do) until ``deadline``."""
        if self.messages[-1]["role"] != "user":
            self.messages.append({"role": "user", "content": f"Step {len(self.messages) // 2}: continue."})
        while True:
            r = httpx.post(
                self.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": self.messages, "max_tokens": 6, "temperature": 0},
                headers={"X-Session-Id": self.session},
                timeout=60,
            )
            if r.status_code == 200:
                body = r.json()
                self.messages.append(
                    {"role": "assistant", "content": body["choices"][0]["message"]["content"]}
                )
                timings = body["timings"]
                self.served.append(
                    (200, r.headers["x-slotkeeper-cache"], timings["cache_n"], body["usage"]["prompt_tokens"])
                )
                return r
            self.served.append((r.status_code, "", 0, 0))
            assert r.status_code == 503, r.text  # a partition costs a retry, never another error
            if time.monotonic() > deadline:
                return r
            time.sleep(float(r.headers.get("retry-after", "1")))

    def record(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.url}/v1/sessions/{self.session}", timeout=10).json())

    def saved(self) -> bool:
        record = self.record()
        return int(record.get("generation", 0)) >= 1 and record.get("dirty") is False


def test_a_node_cut_off_for_30_s_is_routed_around_and_its_sessions_go_on(cluster: Cluster) -> None:
    agents = [Agent(cluster.gateway, f"cut-{i}") for i in range(4)]
    for agent in agents:
        assert agent.turn().status_code == 200
    for agent in agents:
        eventually(f"{agent.session} saved", agent.saved, timeout_s=60)
    on_n1 = [a for a in agents if a.record()["engine"].startswith("n1-")]
    assert on_n1, "the gateway spread the sessions over both nodes"

    cluster.lab.cut("n1")
    t0 = time.monotonic()
    while time.monotonic() - t0 < CUT_S:
        for agent in agents:
            r = agent.turn(deadline=time.monotonic() + 30)
            assert r.status_code == 200, r.text
            # Every session is on the node that answers, reusing its stored or live state.
            assert agent.record()["engine"].startswith("n2-")
            status, cache, reused, prompt = agent.served[-1]
            assert cache in ("live", "restored") and prompt - reused < 40, agent.served[-1]
    cluster.lab.mend("n1")

    # n1 registers again with its slots still holding what its sessions were before the cut. Each
    # session has one record, and its turns go on from its newest state wherever it is placed: one
    # served from n1's stale slot would reuse only the conversation up to the cut.
    for _ in range(2):
        for agent in agents:
            assert agent.turn(deadline=time.monotonic() + 30).status_code == 200
            status, cache, reused, prompt = agent.served[-1]
            assert cache in ("live", "restored") and prompt - reused < 40, agent.served[-1]
    statuses = {s for a in agents for s, *_ in a.served}
    assert statuses <= {200, 503}


def test_a_slow_lossy_store_link_still_serves_and_saves_catch_up(cluster: Cluster) -> None:
    cluster.store_link.delay_s, cluster.store_link.loss = 0.05, 0.02
    try:
        agents = [Agent(cluster.gateway, f"slow-{i}") for i in range(6)]  # more than the slots: evictions
        for _ in range(2):
            for agent in agents:
                assert agent.turn(deadline=time.monotonic() + 30).status_code == 200
        for agent in agents:
            eventually(f"{agent.session} saved over the slow link", agent.saved, timeout_s=120)
        restored = [a for a in agents if any(cache == "restored" for _, cache, _, _ in a.served)]
        assert restored, "some session came back from the store over the slow link"
        assert cluster.store_link.stalls > 0  # the loss happened
    finally:
        cluster.store_link.delay_s, cluster.store_link.loss = 0.0, 0.0


TENANTS = """
[tenants.split]
keys = ["key-split"]
handoff_threshold = 0
[tenants.whole]
keys = ["key-whole"]
handoff_threshold = "off"
"""


def _chat(url: str, key: str, session: str, messages: list[dict[str, Any]]) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
    headers = {"Authorization": f"Bearer {key}", "X-Session-Id": session}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r


def test_two_nodes_that_cannot_meet_hand_a_state_over_through_the_store(
    tiny_model: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """n1 runs the prefill engine, n2 the decode engine, and n2 cannot reach n1 (no route), while
    the gateway reaches both: a new session's split turn goes through the store — 0 prompt tokens
    on n2, the never-split answer, the transient object deleted. A carried follow-up cannot go
    that way: it runs unsplit, live on n2."""
    logs = tmp_path_factory.mktemp("apart")
    model = tiny_model("qwen35")
    tenants = logs / "tenants.toml"
    tenants.write_text(TENANTS)
    with netns.lab() as lab:
        redis, moto = _backends(lab, logs)
        store = moto.endpoint
        nodes = [
            _node(lab, name, model, redis.url, store, logs, "--role", role)
            for name, role in (("n1", "prefill"), ("n2", "decode"))
        ]
        lab.keep_apart("n2", "n1")
        url = _gateway(lab, nodes, redis.url, store, logs, "--tenants", str(tenants))

        probes = itertools.count()

        def splits() -> bool:
            """A new probe session's turn is split: the gateway answers and lists n1's prefill
            engine (a registry read before n1's engine was ready holds until a TTL ends)."""
            try:
                session = f"probe-{next(probes)}"
                probe = _chat(url, "key-split", session, [{"role": "user", "content": "Hi"}])
                return probe.headers["X-Slotkeeper-Cache"] == "handoff"
            except (httpx.TransportError, AssertionError):
                return False

        try:
            eventually("the gateway splitting turns over both nodes' engines", splits, timeout_s=120)
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Tell me about the weather, the time and the place."},
            ]
            whole = _chat(url, "key-whole", "w1", messages)
            split = _chat(url, "key-split", "s1", messages)
            assert split.headers["X-Slotkeeper-Cache"] == "handoff"
            assert split.json()["timings"]["prompt_n"] == 0
            text = split.json()["choices"][0]["message"]["content"]
            assert text == whole.json()["choices"][0]["message"]["content"] and text
            gateway_log = (logs / "gateway.log").read_text()
            assert '"through_store": true' in gateway_log or "through_store=True" in gateway_log
            client = moto.client()
            try:
                listed = client.list_objects_v2(Bucket="slots", Prefix=f"{PREFIX}/.handoffs/")
            finally:
                client.close()
            assert listed.get("KeyCount", 0) == 0  # the transient object is gone
            more = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": "And?"}]
            follow = _chat(url, "key-split", "s1", more)
            assert follow.headers["X-Slotkeeper-Cache"] == "live"  # a carried state goes no such way
        except BaseException:
            _show_logs(logs)
            raise

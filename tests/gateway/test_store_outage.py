"""The store away for 60 s under `slotkeeper serve`: saves wait on the node's disk and are uploaded when
it is back; a session only the store holds answers 503 + Retry-After, or is served from its whole
prompt when its tenant says so; nothing is lost, nothing answers 500.

The store is a real S3 server (moto's) behind a relay the test can take down
(gateway.bench.harness.slow_link): to the node, the endpoint resets and refuses connections, as a
store outage does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.bench.harness.servers import AWS_ENV, INTERNAL_AUTH, eventually, free_port
from gateway.bench.harness.slow_link import SlowLink

MODEL = "qwen35-seed0"
OUTAGE_S = 60.0
TENANTS = """
[tenants.waits]
keys = ["key-waits"]
[tenants.hurries]
keys = ["key-hurries"]
[tenants.hurries.storage]
on_store_outage = "reprefill"
"""
SYSTEM = "You are a coding agent. Read files, run tests, fix bugs, and report briefly. " * 4


class Agent:
    """One tenant's conversation through the gateway, with every status it got."""

    def __init__(self, url: str, tenant: str, session: str) -> None:
        self.url, self.tenant, self.session = url, tenant, session
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM + f" ({session})"}]
        self.statuses: list[int] = []

    def turn(self) -> httpx.Response:
        """The next user message; on success the answer joins the conversation (a refused turn is
        sent again later, as the agents' clients do)."""
        if self.messages[-1]["role"] != "user":
            self.messages.append({"role": "user", "content": f"Step {len(self.messages) // 2}: continue."})
        r = httpx.post(
            self.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": self.messages, "max_tokens": 6, "temperature": 0},
            headers={"Authorization": f"Bearer key-{self.tenant}", "X-Session-Id": self.session},
            timeout=60,
        )
        self.statuses.append(r.status_code)
        if r.status_code == 200:
            answer = r.json()["choices"][0]["message"]["content"]
            self.messages.append({"role": "assistant", "content": answer})
        return r

    def record(self) -> dict[str, Any]:
        r = httpx.get(
            f"{self.url}/v1/sessions/{self.session}",
            headers={"Authorization": f"Bearer key-{self.tenant}"},
            timeout=10,
        )
        return r.json() if r.status_code == 200 else {}

    def saved(self) -> bool:
        record = self.record()
        return int(record.get("generation", 0)) >= 1 and record.get("dirty") is False


def node_metric(node_url: str, name: str) -> float:
    for line in httpx.get(node_url + "/metrics", headers=INTERNAL_AUTH, timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not on the node's /metrics")


@pytest.fixture
def link(moto_server: Any) -> Iterator[SlowLink]:
    relay = SlowLink(("127.0.0.1", free_port()), ("127.0.0.1", moto_server.port))
    yield relay
    relay.close()


def test_a_store_outage_of_a_minute_queues_saves_and_loses_nothing(
    serve: Any, link: SlowLink, moto_server: Any, tmp_path: Path
) -> None:
    (tmp_path / "tenants.toml").write_text(TENANTS)
    prefix = "outage-" + uuid.uuid4().hex[:8]
    s = serve(
        tmp_path / "data",
        slots=4,
        tenants=tmp_path / "tenants.toml",
        args=[
            *("--s3-endpoint", f"http://127.0.0.1:{link.listen[1]}"),
            *("--s3-bucket", "slots"),
            *("--s3-prefix", prefix),
            *("--log-level", "info"),
            *("--ctx", "4096"),
        ],
        # No spill-cache copies of uploaded files: what was evicted is in the store only.
        env={**AWS_ENV, "SLOTKEEPER_SPILL_BYTES": "0", "SLOTKEEPER_FLUSH_INTERVAL": "1"},
    )
    waits, hurries = Agent(s.url, "waits", "w-1"), Agent(s.url, "hurries", "h-1")
    spares = [Agent(s.url, "waits", "w-4"), Agent(s.url, "waits", "w-5")]
    live = [Agent(s.url, "waits", "w-2"), Agent(s.url, "waits", "w-3")]
    everyone = [waits, hurries, *spares, *live]
    # Four slots: w-1 and h-1 are stored, then evicted by w-2 and w-3: the store alone holds them.
    # The spares are the least recently used when the outage starts: w-1's and h-1's turns evict them.
    for agent in everyone:
        assert agent.turn().status_code == 200
        eventually(f"{agent.session} saved", agent.saved, timeout_s=60)
    assert {waits.record()["state"], hurries.record()["state"]} == {"spilled"}

    link.down()
    t0 = time.monotonic()
    # A session only the store holds: 503 + Retry-After for a tenant that waits...
    refused = waits.turn()
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1, refused.text
    # ... served from the whole prompt for one that says so.
    hurried = hurries.turn()
    assert hurried.status_code == 200 and hurried.headers["x-slotkeeper-cache"] == "cold", hurried.text
    # Live sessions go on for the minute, a turn each every few seconds; their saves wait on the
    # node's disk.
    while (left := OUTAGE_S - (time.monotonic() - t0)) > 0:
        for agent in live:
            answered = agent.turn()
            assert answered.status_code == 200, answered.text
            assert answered.headers["x-slotkeeper-cache"] == "live"
        time.sleep(min(left, 4.0))  # the agents' pace, not a wait for anything
    eventually("saves waiting", lambda: node_metric(s.node_url, "slotkeeper_node_uploads_pending") >= 1)
    assert node_metric(s.node_url, "slotkeeper_node_uploads_pending_bytes") > 0
    assert link.refused > 0

    link.up()
    eventually(
        "the waiting saves uploaded",
        lambda: node_metric(s.node_url, "slotkeeper_node_uploads_pending") == 0,
        timeout_s=60,
    )
    # Every session's newest generation is in S3 as the index says, and comes back from there.
    client = moto_server.client()
    try:
        for agent in everyone:
            eventually(f"{agent.session} saved again", agent.saved, timeout_s=60)
            key = agent.record()["blob_key"]
            assert client.head_object(Bucket="slots", Key=key)["ContentLength"] > 0, key
    finally:
        client.close()
    for agent in everyone:
        back = agent.turn()
        assert back.status_code == 200, back.text
        if agent is waits:  # the turn refused during the outage, now restored from the store
            assert back.headers["x-slotkeeper-cache"] == "restored"
    assert waits.statuses.count(503) == 1
    assert all(code in (200, 503) for a in everyone for code in a.statuses)  # never a 500
    log = s.log.read_text()
    assert "node.upload_deferred" in log and "node.flushed" in log


def test_an_index_lost_while_saves_wait_for_the_store_finds_them_on_the_node(
    serve: Any, link: SlowLink, restartable_redis: Any, tmp_path: Path
) -> None:
    """Redis loses the index while the store is away: a session's newest save is on the node's disk
    only (the store holds an older one, and the rebuild cannot list the store yet). Its next turn is
    restored from the node's copy, not started anew."""
    (tmp_path / "tenants.toml").write_text(TENANTS)
    s = serve(
        tmp_path / "data",
        slots=2,
        tenants=tmp_path / "tenants.toml",
        args=[
            *("--s3-endpoint", f"http://127.0.0.1:{link.listen[1]}"),
            *("--s3-bucket", "slots"),
            *("--s3-prefix", "lost-" + uuid.uuid4().hex[:8]),
            *("--redis-url", restartable_redis.url),
            *("--log-level", "info"),
            *("--ctx", "4096"),
        ],
        env={**AWS_ENV, "SLOTKEEPER_FLUSH_INTERVAL": "1"},
    )
    first, second, third = (Agent(s.url, "waits", f"w-{i}") for i in range(1, 4))
    for agent in (first, second):
        assert agent.turn().status_code == 200
        eventually(f"{agent.session} saved", agent.saved, timeout_s=60)

    link.down()
    for agent in (first, second):  # saved again, as generation 2, on the node's disk only
        assert agent.turn().headers["x-slotkeeper-cache"] == "live"
        eventually(f"{agent.session} saved", lambda a=agent: a.saved() and a.record()["generation"] == 2)
    assert third.turn().status_code == 200  # a new session takes the least recently used slot
    assert first.record()["state"] == "spilled"
    eventually("saves waiting", lambda: node_metric(s.node_url, "slotkeeper_node_uploads_pending") >= 2)

    assert restartable_redis.command("FLUSHALL") == b"+OK"
    deadline = time.monotonic() + 30
    while (back := first.turn()).status_code == 503 and time.monotonic() < deadline:
        time.sleep(float(back.headers.get("retry-after", "1")))  # the node registers its engines again
    assert back.status_code == 200, back.text
    assert back.headers["x-slotkeeper-cache"] == "restored", back.headers
    assert back.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert "index.look_up_store_failed" in s.log.read_text()  # found on the node, not in the store

    link.up()
    eventually(
        "the waiting saves uploaded",
        lambda: node_metric(s.node_url, "slotkeeper_node_uploads_pending") == 0,
        timeout_s=60,
    )
    assert all(code in (200, 503) for a in (first, second, third) for code in a.statuses)

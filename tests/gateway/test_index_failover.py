"""The index's primary killed under load: a Redis Cluster shard's primary, or the Sentinel master.

`slotkeeper serve` runs against the topology with 8 sessions in 8 slots and turns running. The
primary is SIGKILLed while they run; its replica is promoted. Turns answer meanwhile (503 +
Retry-After at most while the shard has no primary), the gateway notices the promotion (a primary
whose replication history it never saw: storage.index.epoch) and heals the index as after a loss,
and every session's next turn reuses its whole conversation, as it did before the failover.

A cluster shard without any primary left (its replica killed too) answers 503 for its tenants only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.bench.harness.redis_topologies import redis_cluster, redis_sentinel

from .conftest import openai_client
from .test_index_healing import MODEL, SESSIONS, SYSTEM, metric, retried, saved, turn, two_turns


@pytest.fixture(params=["cluster", "sentinel", "valkey-cluster", "valkey-sentinel"])
def topology(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A set-up of this test's own (of redis-servers or valkey-servers): the test kills its primary."""
    start = redis_sentinel if request.param.endswith("sentinel") else redis_cluster
    server = "valkey" if request.param.startswith("valkey") else "redis"
    with start(tmp_path / "redis", server=server) as servers:
        yield servers


def primary_of(servers: Any, tenant: str) -> int:
    """The port of the primary that holds the tenant's keys (the Sentinel master: all of them)."""
    if not hasattr(servers, "primary_of"):
        return int(servers.master_port())
    return int(servers.primary_of(f"slotkeeper:{{t:{tenant}}}"))


def test_a_failover_under_load_keeps_every_sessions_reuse(serve, topology: Any, tmp_path: Path) -> None:
    s = serve(
        tmp_path / "data", slots=len(SESSIONS), args=["--redis-url", topology.url, "--log-level", "info"]
    )
    client = openai_client(s.url)
    convs = {sid: [{"role": "system", "content": SYSTEM + f" You are agent {sid}."}] for sid in SESSIONS}
    live_gap = two_turns(client, convs)
    for sid in SESSIONS:
        try:
            from gateway.bench.harness.servers import eventually

            eventually(f"{sid}'s save", lambda sid=sid: saved(s.url, sid), timeout_s=60)
        except TimeoutError:
            raise AssertionError(f"{sid} not saved\n{s.log.read_text()[-6000:]}") from None

    # Load: one agent keeps taking turns on its own conversation while the primary dies.
    load_sid, answered, statuses = "agent-load", [], []
    load_conv = [{"role": "system", "content": SYSTEM + " You are the load."}]
    stop = threading.Event()

    def load() -> None:
        step = 0
        while not stop.is_set():
            msgs = [*load_conv, {"role": "user", "content": f"Load step {step}."}]
            r = httpx.post(
                s.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": msgs, "max_tokens": 4, "temperature": 0},
                headers={"X-Session-Id": load_sid},
                timeout=60,
            )
            statuses.append(r.status_code)
            if r.status_code == 503:
                assert r.headers.get("retry-after"), r.text
            elif r.status_code == 200:
                answered.append(step)
            step += 1

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    from gateway.bench.harness.servers import eventually

    eventually("load turns answered", lambda: len(answered) >= 2, timeout_s=60)
    dead = primary_of(topology, "default")
    rebuilds = metric(s.url, "slotkeeper_gateway_index_rebuilds_total")
    if hasattr(topology, "kill_primary"):
        topology.kill_primary(dead)
    else:
        topology.kill_master()
    topology.wait_promoted(dead)
    before = len(answered)
    eventually("load turns answered after the failover", lambda: len(answered) >= before + 2, timeout_s=60)
    stop.set()
    worker.join(120)
    assert set(statuses) <= {200, 503}, statuses
    eventually(
        "the index healed after the failover",
        lambda: metric(s.url, "slotkeeper_gateway_index_rebuilds_total") >= rebuilds + 1,
        timeout_s=60,
    )

    back = time.monotonic()
    for sid, msgs in convs.items():
        msgs.append({"role": "user", "content": "Step 2: continue."})
        _, cache, reused, prompt = retried(lambda sid=sid, msgs=msgs: turn(client, sid, msgs), back + 60)
        # The whole conversation before this step was reused, as on the live slot before.
        assert cache in ("live", "restored"), (sid, cache)
        assert prompt - reused <= live_gap[sid], (sid, cache, reused, prompt, live_gap[sid])
    assert metric(s.url, "slotkeeper_gateway_restores_reprefilled_total") == 0
    listed = {d["id"] for d in httpx.get(s.url + "/v1/sessions", timeout=10).json()["data"]}
    assert set(SESSIONS) <= listed


def _tenant_on(servers: Any, port: int) -> str:
    """A tenant name whose keys live on the shard of ``port``."""
    return next(f"tenant{i}" for i in range(1000) if primary_of(servers, f"tenant{i}") == port)


def test_a_shard_without_primary_refuses_its_tenants_only(serve, tmp_path: Path) -> None:
    with redis_cluster(tmp_path / "redis") as servers:
        tenants = {port: _tenant_on(servers, port) for port in servers.primary_ports()}  # one per shard
        (tmp_path / "tenants.toml").write_text(
            "".join(f'[tenants.{t}]\nkeys = ["key-{t}"]\n\n' for t in tenants.values())
        )
        s = serve(
            tmp_path / "data",
            slots=4,
            tenants=tmp_path / "tenants.toml",
            args=["--redis-url", servers.url, "--log-level", "info"],
        )
        clients = {t: openai_client(s.url, key=f"key-{t}") for t in tenants.values()}
        convs = {t: [{"role": "system", "content": SYSTEM + f" You work for {t}."}] for t in tenants.values()}
        for t, msgs in convs.items():
            msgs.append({"role": "user", "content": "Step 0."})
            msgs.append({"role": "assistant", "content": turn(clients[t], f"{t}-s", msgs)[0]})
        auth = {"Authorization": f"Bearer key-{next(iter(convs))}"}
        engine = httpx.get(f"{s.url}/v1/sessions/{next(iter(convs))}-s", headers=auth, timeout=10).json()[
            "engine"
        ]
        # The shard to lose holds neither the registry ({g}) nor the engine's occupancy ({e:...}): those
        # are every tenant's (docs/operations.md says so).
        shared = {servers.primary_of("slotkeeper:{g}"), servers.primary_of(f"slotkeeper:{{e:{engine}}}")}
        lost = next(p for p in tenants if p not in shared)
        servers.kill_shard(lost)

        for port, t in tenants.items():
            msgs = [*convs[t], {"role": "user", "content": "Step 1."}]
            if port == lost:
                with pytest.raises(openai.APIStatusError) as refused:
                    turn(clients[t], f"{t}-s", msgs)
                assert refused.value.status_code == 503, refused.value
                assert refused.value.response.headers.get("retry-after")
            else:
                _, cache, _, _ = turn(clients[t], f"{t}-s", msgs)
                assert cache == "live", (t, cache)

"""Two nodes, one stateless gateway, a real redis-server and a real S3 server (moto): a session
survives its node's SIGTERM (restored on the other node from S3) and a Redis flush (reindex)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis as redis_sync
from support.servers import free_port, stop, wait_until

MODEL = "qwen35-seed0"
SYSTEM = "You are a coding agent. Read files, run tests, fix bugs, and report briefly. " * 4
ENV = {
    **os.environ,
    "AWS_ACCESS_KEY_ID": "test",
    "AWS_SECRET_ACCESS_KEY": "test",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class Proc:
    def __init__(self, name: str, cmd: list[str], log: Path, url: str) -> None:
        self.name, self.url, self.log = name, url, log
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
def cluster(tiny_model, redis_port, moto_server, tmp_path: Path) -> Iterator[dict]:
    prefix = f"c{uuid.uuid4().hex[:8]}"
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    s3 = ["--s3-endpoint", moto_server.endpoint, "--s3-bucket", "slots", "--s3-prefix", prefix]
    common = ["--redis-url", redis_url, "--redis-prefix", prefix, *s3]
    procs: list[Proc] = []
    nodes = {}
    for name in ("n1", "n2"):
        port = free_port()
        cmd = [sys.executable, "-m", "gateway.cli", "node", "--model", tiny_model("qwen35"), "--slots", "2",
               "--ctx", "2048", "--port", str(port), "--node-id", name, "--data-dir", str(tmp_path / name),
               "--log-level", "warning", *common]  # fmt: skip
        p = Proc(name, cmd, tmp_path / f"{name}.log", f"http://127.0.0.1:{port}")
        procs.append(p)
        nodes[name] = p
    gw_port = free_port()
    gw_cmd = [sys.executable, "-m", "gateway.cli", "gateway", "--port", str(gw_port), "--data-dir",
              str(tmp_path / "gw"), "--log-level", "warning", *common,
              *[a for p in procs for a in ("--node", p.url)]]  # fmt: skip
    gw = Proc("gateway", gw_cmd, tmp_path / "gateway.log", f"http://127.0.0.1:{gw_port}")
    procs.append(gw)
    try:
        for p in procs:
            p.wait_ready("/health")
        deadline = time.monotonic() + 60
        while httpx.get(gw.url + "/ready").json()["engines"] < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        yield {"gateway": gw, "nodes": nodes, "redis_url": redis_url, "prefix": prefix, "s3": s3}
    finally:
        for p in procs:
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
    msgs = [{"role": "system", "content": SYSTEM}]
    for turn in range(2):
        msgs.append({"role": "user", "content": f"Step {turn}: run the tests."})
        done, headers, _ = _turn(gw.url, msgs, "agent-7")
        msgs.append({"role": "assistant", "content": done.choices[0].message.content})
    home = _node_of(gw.url, "agent-7")
    node = cluster["nodes"][home]
    node.proc.send_signal(signal.SIGTERM)  # drains: spills agent-7 to S3, exits
    assert node.proc.wait(60) == 0, node.log.read_text()[-2000:]
    rec = httpx.get(f"{gw.url}/v1/sessions/agent-7").json()
    assert rec["state"] == "spilled" and rec["generation"] >= 2

    msgs.append({"role": "user", "content": "Step 2: and now?"})
    done, headers, timings = _turn(gw.url, msgs, "agent-7")
    assert headers["x-slotkeeper-cache"] == "restored"
    assert _node_of(gw.url, "agent-7") != home
    assert timings["restored"] and timings["cache_n"] > done.usage.prompt_tokens // 2
    msgs.append({"role": "assistant", "content": done.choices[0].message.content})

    # Redis loses everything; storage is the source of truth.
    r = redis_sync.Redis.from_url(cluster["redis_url"])
    r.flushall()
    r.close()
    reindex = [sys.executable, "-m", "gateway.cli", "reindex", "--redis-url", cluster["redis_url"]]
    reindex += ["--redis-prefix", cluster["prefix"], *cluster["s3"]]
    rc = subprocess.run(reindex, env=ENV, capture_output=True, text=True, timeout=60)
    assert rc.returncode == 0, rc.stdout + rc.stderr
    assert httpx.get(f"{gw.url}/v1/sessions/agent-7").json()["state"] == "spilled"
    deadline = time.monotonic() + 30  # the surviving node re-registers its engine on its next heartbeat
    while httpx.get(gw.url + "/ready").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.3)
    msgs.append({"role": "user", "content": "Step 3: finish."})
    done, headers, timings = _turn(gw.url, msgs, "agent-7")
    assert headers["x-slotkeeper-cache"] == "restored" and timings["cache_n"] > 0

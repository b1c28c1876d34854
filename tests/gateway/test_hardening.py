"""A hostile tenant against the shared pool: `slotkeeper serve` with a real redis-server and S3 (moto's
server), two honest tenants and a hostile one. Each test sends one kind of bad input, asserts the
precise answer, and then checks that the honest tenant's session is still live in its slot and
reuses its whole previous prompt (`X-Slotkeeper-Cache: live`, cached tokens >= the last prompt).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import string
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.bench.harness.servers import INTERNAL_AUTH
from storage.errors import LockLost
from storage.index.locks import SessionLock, SessionLocks
from storage.index.session_index import SessionIndex

from .conftest import Serve, start_serve

MODEL = "qwen35-seed0"
AWS = {
    "AWS_ACCESS_KEY_ID": "test",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-for-tests",
    "AWS_DEFAULT_REGION": "us-east-1",
}
LOCK_TTL_S = 4.0
TENANTS = """
[tenants.alice]
keys = ["key-alice"]
[tenants.mallory]
keys = ["key-mallory"]
[tenants.mallory.quotas]
inflight = 2
requests_per_minute = 100000
[tenants.bob]
keys = ["key-bob"]
[tenants.bob.quotas]
live_slots = 1
[tenants.carol]
keys = ["key-carol"]
[tenants.carol.quotas]
stored_bytes = 1
[tenants.dave]
keys = ["key-dave"]
[tenants.dave.quotas]
sessions = 2
live_slots = 1
"""


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer key-{tenant}"}


class Pool:
    """The running `serve` plus what the tests need to reach its Redis keys."""

    def __init__(self, serve: Serve, redis_url: str, prefix: str) -> None:
        self.serve = serve
        self.url = serve.url
        self.redis_url = redis_url
        self.prefix = prefix
        self.http = httpx.Client(base_url=serve.url, timeout=120)
        self.honest: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a careful coding agent. " * 8}
        ]
        self.last_prompt_tokens = 0

    def chat(
        self, tenant: str, messages: list[dict[str, Any]], session: str | None = None, **extra: Any
    ) -> httpx.Response:
        headers = {**auth(tenant), **({"X-Session-Id": session} if session else {})}
        body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, **extra}
        return self.http.post("/v1/chat/completions", json=body, headers=headers)

    def honest_turn(self) -> httpx.Response:
        self.honest.append({"role": "user", "content": f"Step {len(self.honest)}: run the tests again."})
        r = self.chat("alice", self.honest, session="alice-main")
        assert r.status_code == 200, r.text
        self.honest.append(
            {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or ""}
        )
        return r

    def assert_honest_still_live(self) -> None:
        """The honest session answers from its own slot, reusing at least its whole previous prompt."""
        before = self.last_prompt_tokens
        r = self.honest_turn()
        usage = r.json()["usage"]
        assert r.headers["x-slotkeeper-cache"] == "live", r.headers
        assert usage["prompt_tokens_details"]["cached_tokens"] >= before > 0, usage
        self.last_prompt_tokens = usage["prompt_tokens"]

    def run(self, coro: Any) -> Any:
        return asyncio.run(coro)

    async def with_redis(self, fn: Any) -> Any:
        client = aioredis.from_url(self.redis_url, decode_responses=True)
        try:
            return await fn(client)
        finally:
            await client.aclose()

    def engines(self) -> list[dict[str, Any]]:
        return self.serve.engines()


@pytest.fixture(scope="module")
def pool(tiny_model, redis_port, moto_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    tmp = tmp_path_factory.mktemp("hardening")
    (tmp / "tenants.toml").write_text(TENANTS)
    prefix = "hard-" + uuid.uuid4().hex[:8]
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    args = [
        *("--redis-url", redis_url),
        *("--redis-prefix", prefix),
        *("--s3-endpoint", moto_server.endpoint),
        *("--s3-bucket", "slots"),
        *("--s3-prefix", prefix),
        *("--lock-ttl-s", str(LOCK_TTL_S)),
        *("--header-timeout-s", "2"),
        *("--body-timeout-s", "2"),
        *("--max-body-bytes", "1M"),
        *("--max-json-depth", "32"),
        *("--max-messages", "64"),
        *("--spill-wait-s", "5"),
    ]
    serve = start_serve(
        tiny_model("qwen35"),
        tmp / "data",
        tmp / "serve.log",
        slots=4,
        tenants=tmp / "tenants.toml",
        args=args,
        env=AWS,
    )
    p = Pool(serve, redis_url, prefix)
    try:
        r = p.honest_turn()  # the honest session, live from here on
        p.last_prompt_tokens = r.json()["usage"]["prompt_tokens"]
        yield p
    finally:
        p.http.close()
        serve.stop()


def error_of(r: httpx.Response) -> dict[str, Any]:
    err = r.json()["error"]
    assert isinstance(err["code"], str) or err["code"] is None, err
    return err


# -- inputs that used to crash or stall an engine -------------------------------------------------
def test_a_deeply_nested_grammar_is_refused_and_the_engine_keeps_its_sessions(pool: Pool) -> None:
    grammar = "root ::= " + "(" * 50_000 + '"a"' + ")" * 50_000
    r = pool.chat("mallory", [{"role": "user", "content": "hi"}], grammar=grammar)
    assert r.status_code == 400, r.text
    assert "grammar" in error_of(r)["message"]
    pool.assert_honest_still_live()


def test_a_schema_with_thousands_of_optional_properties_is_linear_or_refused(pool: Pool) -> None:
    props = {f"field_{i}": {"type": "string"} for i in range(3000)}
    schema = {"type": "object", "properties": props}
    fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}
    r = pool.chat("mallory", [{"role": "user", "content": "hi"}], response_format=fmt)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert error_of(r)["type"] == "invalid_request_error"
    pool.assert_honest_still_live()


# -- limits at the gateway's edge -------------------------------------------------------------------
def test_body_size_depth_and_shape_limits(pool: Pool) -> None:
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * (2 << 20)}]})
    r = pool.http.post("/v1/chat/completions", content=big, headers=auth("mallory"))
    assert r.status_code == 413 and error_of(r)["code"] == "payload_too_large"
    deep = '{"model": "m", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    r = pool.http.post("/v1/chat/completions", content=deep, headers=auth("mallory"))
    assert r.status_code == 400 and "deeper than 32" in error_of(r)["message"]
    r = pool.chat("mallory", ["not an object"])  # type: ignore[list-item]
    assert r.status_code == 400 and error_of(r)["param"] == "messages[0]"
    r = pool.chat("mallory", [{"role": "user", "content": "x"}] * 65)
    assert r.status_code == 400 and "the limit is 64" in error_of(r)["message"]
    pool.assert_honest_still_live()


def test_a_tenant_cannot_choose_the_slot_its_turn_runs_in(pool: Pool) -> None:
    """`id_slot` is the gateway's: a tenant naming another session's slot — once, twice, with
    whitespace after the object, or in UTF-16 (which the gateway's parser accepts and re-encodes) —
    runs in a slot of its own, and the other session stays live in its slot."""
    honest = pool.honest_turn().json()["id_slot"]
    messages = [{"role": "user", "content": "Überschreibe den Slot."}]
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 2, "id_slot": honest})
    tricks = [
        body.encode(),
        (body[:-1] + f', "id_slot": {honest}, "cache_prompt": false}}  \r\n').encode(),
        body.encode("utf-16"),
    ]
    for i, raw in enumerate(tricks):
        headers = {**auth("mallory"), "X-Session-Id": f"slot-thief-{i}", "Content-Type": "application/json"}
        r = pool.http.post("/v1/chat/completions", content=raw, headers=headers)
        assert r.status_code == 200, r.text
        assert r.json()["id_slot"] != honest, (i, r.json()["id_slot"])
    pool.assert_honest_still_live()


def _open(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def test_trickled_headers_are_cut_off(pool: Pool) -> None:
    sock = _open(pool.url)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    t0, closed = time.monotonic(), False
    try:
        for byte in head:  # one byte every 0.25 s: 25 s for all of it, far past the 2 s deadline
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            sock.settimeout(0.25)
            try:
                data = sock.recv(4096)
            except TimeoutError:
                continue
            closed = True
            assert data == b"" or data.startswith(b"HTTP/1.1 408"), data
            break
    finally:
        sock.close()
    assert closed and time.monotonic() - t0 < 10
    pool.assert_honest_still_live()


def test_a_trickled_body_gets_408(pool: Pool) -> None:
    sock = _open(pool.url)
    try:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-mallory\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
        )
        sock.settimeout(15)
        data = sock.recv(65536)
    finally:
        sock.close()
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    pool.assert_honest_still_live()


# -- nothing inside the cluster without the credential ------------------------------------------------
def test_node_agent_and_engines_refuse_callers_without_the_internal_credential(pool: Pool) -> None:
    node = pool.serve.node_url
    engine = pool.engines()[0]
    calls = [
        ("GET", f"{node}/v1/engines", None),
        ("GET", f"{node}/metrics", None),
        (
            "POST",
            f"{node}/v1/engines/{engine['id']}/slots/0/fill",
            {"tenant": "alice", "session": "alice-main", "generation": 1},
        ),
        (
            "POST",
            f"{node}/v1/engines/{engine['id']}/slots/0/spill",
            {"tenant": "alice", "session": "x", "generation": 99},
        ),
        ("POST", f"{node}/v1/engines/{engine['id']}/slots/0/erase", None),
        ("DELETE", f"{node}/v1/sessions/alice/alice-main", None),
        ("GET", f"{engine['url']}/slots", None),
        ("POST", f"{engine['url']}/completion", {"prompt": "hi", "n_predict": 1}),
        ("POST", f"{engine['url']}/slots/0?action=erase", None),
    ]
    for method, url, body in calls:
        for headers in ({}, {"Authorization": "Bearer key-alice"}, {"Authorization": "Bearer " + "x" * 40}):
            r = httpx.request(method, url, json=body, headers=headers, timeout=10)
            assert r.status_code == 401, (method, url, r.status_code, r.text)
            assert error_of(r)["code"] == "invalid_api_key"
    health = httpx.get(f"{node}/health", timeout=5)
    assert health.status_code == 200 and set(health.json()) == {"status", "node"}
    pool.assert_honest_still_live()


def test_engines_do_not_inherit_the_store_credentials(pool: Pool) -> None:
    pid = pool.engines()[0]["pid"]
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    names = {e.split(b"=", 1)[0].decode() for e in environ if e}
    assert "SLOTKEEPER_API_KEY" in names
    leaked = {
        n for n in names if n.startswith(("AWS_", "SLOTKEEPER_S3", "SLOTKEEPER_INTERNAL", "SLOTKEEPER_REDIS"))
    }
    assert not leaked
    assert b"aws-secret-for-tests" not in b"\0".join(environ)


# -- faults stay local -----------------------------------------------------------------------------------
def _wait_durable(pool: Pool, tenant: str, session: str, generation: int = 1) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rec = pool.http.get(f"/v1/sessions/{session}", headers=auth(tenant)).json()
        if rec.get("generation", 0) >= generation:
            return rec
        time.sleep(0.05)
    raise AssertionError(f"{session} never became durable: {rec}")


def test_delete_removes_every_copy_and_the_id_starts_clean(pool: Pool, moto_server) -> None:
    sid = "reuse-" + uuid.uuid4().hex[:6]
    msgs = [{"role": "user", "content": "remember the number 7"}]
    assert pool.chat("mallory", msgs, session=sid).status_code == 200
    _wait_durable(pool, "mallory", sid)
    r = pool.http.delete(f"/v1/sessions/{sid}", headers=auth("mallory"))
    assert r.status_code == 200 and r.json()["deleted"] is True
    s3 = moto_server.client()
    try:
        listed = s3.list_objects_v2(Bucket="slots", Prefix=f"{pool.prefix}/mallory/{sid}/")
    finally:
        s3.close()
    assert listed.get("KeyCount", 0) == 0
    assert pool.http.get(f"/v1/sessions/{sid}", headers=auth("mallory")).status_code == 404
    # The same id again: a new session whose saves work (no generation collides with the old one).
    again: list[dict[str, Any]] = []
    for turn in range(2):
        again.append({"role": "user", "content": f"start over {turn}"})
        r = pool.chat("mallory", again, session=sid)
        assert r.status_code == 200, r.text
        assert r.headers["x-slotkeeper-cache"] == ("cold" if turn == 0 else "live")
        again.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or ""})
    rec = _wait_durable(pool, "mallory", sid)
    assert rec["state"] == "live"
    # Push it out of its slot (the honest session stays the most recently used): placement works.
    for i in range(3):
        pool.honest_turn()
        assert (
            pool.chat("mallory", [{"role": "user", "content": "fill"}], session=f"{sid}-x{i}").status_code
            == 200
        )
    assert pool.http.get(f"/v1/sessions/{sid}", headers=auth("mallory")).json()["state"] == "spilled"
    pool.assert_honest_still_live()
    r = pool.chat("mallory", [*again, {"role": "user", "content": "and now?"}], session=sid)
    assert r.status_code == 200 and r.headers["x-slotkeeper-cache"] in ("live", "restored")


@contextlib.contextmanager
def held(pool: Pool, tenant: str, session: str, ttl_s: float = 60) -> Iterator[None]:
    """The session as a request running on it leaves it: locked, and out of its engine's idle LRU."""

    async def take(client: Any) -> SessionLock:
        # Waits for the session's own bookkeeping (its after-turn save holds the lock a moment).
        lock = await SessionLocks(client, prefix=pool.prefix).acquire(tenant, session, ttl_s=ttl_s, wait_s=30)
        await SessionIndex(client, prefix=pool.prefix).mark_busy(tenant, session, lock=lock)
        return lock

    lock = pool.run(pool.with_redis(take))
    try:
        yield
    finally:

        async def give_back(client: Any) -> None:
            with contextlib.suppress(LockLost):
                await SessionIndex(client, prefix=pool.prefix).mark_idle(tenant, session, lock=lock)
                await SessionLocks(client, prefix=pool.prefix).release(lock)

        pool.run(pool.with_redis(give_back))


def test_a_busy_session_forks_whatever_its_id_ends_with(pool: Pool) -> None:
    sid = "dot2."
    assert pool.chat("mallory", [{"role": "user", "content": "a"}], session=sid).status_code == 200
    _wait_durable(pool, "mallory", sid)
    with held(pool, "mallory", sid):  # a live request (renewing) holds it
        r = pool.chat(
            "mallory", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], session=sid
        )
    assert r.status_code == 200, r.text
    # The parent is live on the engine: the fork starts there from its slot, not from storage.
    assert r.headers["x-session-id"].startswith("dot2.f") and r.headers["x-slotkeeper-cache"] == "prefix"
    pool.assert_honest_still_live()


def test_a_session_whose_holder_died_is_waited_for_not_forked(pool: Pool) -> None:
    sid = "holder-" + uuid.uuid4().hex[:6]
    first = pool.chat("mallory", [{"role": "user", "content": "a"}], session=sid)
    assert first.status_code == 200
    reply = {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"] or ""}
    _wait_durable(pool, "mallory", sid)

    # A gateway that died holding the lock: nobody renews it; it lapses within the (short) TTL.
    async def die_holding(client: Any) -> None:
        locks, index = SessionLocks(client, prefix=pool.prefix), SessionIndex(client, prefix=pool.prefix)
        lock = await locks.acquire("mallory", sid, ttl_s=LOCK_TTL_S / 3, wait_s=30)
        await index.mark_busy("mallory", sid, lock=lock)  # a request was running; nobody renews or releases

    pool.run(pool.with_redis(die_holding))
    t0 = time.monotonic()
    r = pool.chat(
        "mallory",
        [{"role": "user", "content": "a"}, reply, {"role": "user", "content": "again"}],
        session=sid,
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-session-id"] == sid  # not a fork
    assert time.monotonic() - t0 < LOCK_TTL_S + 5
    pool.assert_honest_still_live()


def test_a_deleted_id_reused_while_an_eviction_still_holds_its_lock_waits_instead_of_forking(
    pool: Pool,
) -> None:
    sid = "ghost-" + uuid.uuid4().hex[:6]  # no record: deleted a moment ago, its evictor still finishing

    async def hold_then_release(client: Any) -> None:
        locks = SessionLocks(client, prefix=pool.prefix)
        lock = await locks.acquire("mallory", sid, ttl_s=60, wait_s=5)
        await asyncio.sleep(1.0)  # the evictor's work; the request below arrives meanwhile
        await locks.release(lock)

    holder = threading.Thread(target=pool.run, args=(pool.with_redis(hold_then_release),))
    holder.start()
    try:
        deadline = time.monotonic() + 10
        while not pool.run(
            pool.with_redis(lambda c: SessionLocks(c, prefix=pool.prefix).owner("mallory", sid))
        ):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # (a prompt of its own: an earlier session's identical prompt would be a start, `prefix`)
        r = pool.chat("mallory", [{"role": "user", "content": f"again, {sid}"}], session=sid)
    finally:
        holder.join()
    assert r.status_code == 200, r.text
    assert r.headers["x-session-id"] == sid and r.headers["x-slotkeeper-cache"] == "cold"
    pool.assert_honest_still_live()


# -- quotas, exactly --------------------------------------------------------------------------------------
def test_live_slots_are_counted_after_placement_whoever_is_evicted(pool: Pool) -> None:
    assert pool.chat("bob", [{"role": "user", "content": "one"}], session="b1").status_code == 200
    r = pool.chat("bob", [{"role": "user", "content": "two"}], session="b2")
    assert r.status_code == 200, r.text  # room made by evicting bob's own b1, not another tenant
    states = {
        s: pool.http.get(f"/v1/sessions/{s}", headers=auth("bob")).json()["state"] for s in ("b1", "b2")
    }
    assert states == {"b1": "spilled", "b2": "live"}
    with held(pool, "bob", "b2"):  # b2 busy: bob has no idle slot of its own to give up
        r = pool.chat("bob", [{"role": "user", "content": "three"}], session="b3")
    assert r.status_code == 429 and error_of(r)["type"] == "rate_limit_error", r.text
    assert "retry-after" in r.headers
    pool.assert_honest_still_live()


def test_sessions_quota_and_failed_placements_leave_no_record(pool: Pool) -> None:
    for sid in ("d1", "d2"):
        assert pool.chat("dave", [{"role": "user", "content": sid}], session=sid).status_code == 200
    r = pool.chat("dave", [{"role": "user", "content": "d3"}], session="d3")
    assert r.status_code == 429 and error_of(r)["code"] == "quota_exceeded"
    assert pool.http.get("/v1/sessions/d3", headers=auth("dave")).status_code == 404
    listed = pool.http.get("/v1/sessions", headers=auth("dave")).json()["data"]
    assert sorted(s["id"] for s in listed) == ["d1", "d2"]
    assert pool.http.delete("/v1/sessions/d1", headers=auth("dave")).status_code == 200
    with held(pool, "dave", "d2"):  # its one live slot busy: a new session cannot be placed
        r = pool.chat("dave", [{"role": "user", "content": "d4"}], session="d4")
    assert r.status_code == 429, r.text
    assert pool.http.get("/v1/sessions/d4", headers=auth("dave")).status_code == 404  # no record left
    pool.assert_honest_still_live()


def test_stored_bytes_are_enforced(pool: Pool) -> None:
    assert pool.chat("carol", [{"role": "user", "content": "first"}], session="c1").status_code == 200
    _wait_durable(pool, "carol", "c1")
    r = pool.chat("carol", [{"role": "user", "content": "second"}], session="c2")
    assert r.status_code == 429 and "stores" in error_of(r)["message"]
    # Its existing session still works.
    r = pool.chat(
        "carol",
        [
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "more"},
        ],
        session="c1",
    )
    assert r.status_code == 200
    pool.assert_honest_still_live()


def test_in_flight_requests_per_tenant_get_429_with_retry_after(pool: Pool) -> None:
    async def occupy(client: Any) -> list[str]:
        index = SessionIndex(client, prefix=pool.prefix)
        tokens = [await index.acquire_inflight("mallory", 2, ttl_s=60) for _ in range(2)]
        assert all(tokens)
        return [t for t in tokens if t]

    tokens = pool.run(pool.with_redis(occupy))
    r = pool.chat("mallory", [{"role": "user", "content": "one more"}])
    assert r.status_code == 429 and "2 requests running" in error_of(r)["message"]
    assert r.headers["retry-after"] == "1"

    async def free(client: Any) -> None:
        index = SessionIndex(client, prefix=pool.prefix)
        for token in tokens:
            await index.release_inflight("mallory", token)

    pool.run(pool.with_redis(free))
    assert pool.chat("mallory", [{"role": "user", "content": "one more"}]).status_code == 200
    pool.assert_honest_still_live()


def test_rate_counters_and_routing_keys_expire(pool: Pool) -> None:
    assert pool.chat("mallory", [{"role": "user", "content": "counted"}]).status_code == 200

    async def ttls(client: Any) -> dict[str, int]:
        out = {}
        for tenant in ("alice", "mallory"):
            async for key in client.scan_iter(match=f"{pool.prefix}:{{t:{tenant}}}:*"):
                out[key] = await client.ttl(key)
        return out

    keys = pool.run(pool.with_redis(ttls))
    routes = {k: v for k, v in keys.items() if ":px:" in k or ":sx:" in k}
    windows = {k: v for k, v in keys.items() if ":w:rpm:" in k}  # mallory's requests per minute
    assert routes and all(v > 0 for v in routes.values()), routes
    assert windows and all(0 < v <= 120 for v in windows.values()), windows


# -- observability cannot be used against the gateway ------------------------------------------------------
def test_unmatched_paths_share_one_metrics_label(pool: Pool) -> None:
    secret = "sk-" + "".join(random.choices(string.ascii_letters, k=24))
    for i in range(300):
        assert pool.http.get(f"/v1/{secret}/{i}").status_code == 404
    metrics = pool.http.get("/metrics").text
    assert secret not in metrics
    series = [line for line in metrics.splitlines() if line.startswith("slotkeeper_gateway_requests_total{")]
    paths = {line.split('path="')[1].split('"')[0] for line in series}
    assert "other" in paths and len(paths) < 12, paths


def test_error_bodies_carry_string_codes_everywhere(pool: Pool) -> None:
    answers = [
        pool.http.post("/v1/chat/completions", json={"model": MODEL, "messages": []}),  # 401
        pool.chat("alice", [{"role": "user", "content": "x"}], session="../x"),  # 400
        pool.http.post("/v1/chat/completions", json={"model": "nope", "messages": []}, headers=auth("alice")),
        pool.http.get("/v1/sessions/none-such", headers=auth("alice")),  # 404
        httpx.get(pool.serve.node_url + "/v1/engines"),  # node 401
        httpx.post(pool.serve.node_url + "/v1/engines/x/slots/0/erase", headers=INTERNAL_AUTH),  # node 404
    ]
    assert [r.status_code for r in answers] == [401, 400, 404, 404, 401, 404]
    for r in answers:
        error_of(r)

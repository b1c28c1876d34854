"""Retention through `slotkeeper serve`: a DELETE frees the chunks only its session named, an idle
session past its tenant's TTL goes by itself, the stored-bytes quota counts unique bytes, and the
one-machine spill cache keeps no second copy of what the local store holds."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import httpx

from gateway.retention import Retention
from storage.errors import LockBusy

from .conftest import eventually

MODEL = "qwen35-seed0"
SYSTEM = "You are a coding agent. Read files, run tests, fix bugs, and report briefly. " * 30


def _chat(url: str, key: str, session: str, text: str) -> httpx.Response:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": messages}
    return httpx.post(
        f"{url}/v1/chat/completions",
        json=body,
        timeout=120,
        headers={"Authorization": f"Bearer {key}", "X-Session-Id": session},
    )


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def _tenants(tmp_path: Path, plain: str, other: str, storage: str) -> Path:
    """A tenants file of `plain` and `other` (each with the key `key-<name>`), `other` with the
    storage setting `storage`."""
    path = tmp_path / "tenants.toml"
    path.write_text(
        f'[tenants.{plain}]\nkeys = ["key-{plain}"]\n'
        f'[tenants.{other}]\nkeys = ["key-{other}"]\n[tenants.{other}.storage]\n{storage}\n'
    )
    return path


def _durable(url: str, key: str, session: str) -> bool:
    r = httpx.get(f"{url}/v1/sessions/{session}", headers={"Authorization": f"Bearer {key}"}, timeout=5)
    return r.status_code == 200 and r.json().get("generation", 0) >= 1


def test_delete_frees_its_own_chunks_and_idle_sessions_expire(serve: Any, tmp_path: Path) -> None:
    tenants = _tenants(tmp_path, "keep", "brief", "idle_ttl_s = 2")
    data = tmp_path / "data"
    s = serve(data, tenants=tenants, args=("--collect-interval-s", "1"))
    blobs = data / "blobs" / "slotkeeper"
    for session in ("a", "b"):
        assert _chat(s.url, "key-keep", session, f"Task {session}: list the files.").status_code == 200
        eventually(f"{session} durable", lambda x=session: _durable(s.url, "key-keep", x))
    # the one machine's spill cache holds no copy of what the local store has
    eventually("spill cache emptied", lambda: not [p for p in _files(data / "spill") if p.suffix == ".slot"])
    chunks = blobs / "keep" / ".chunks"
    before = {p.name for p in _files(chunks)}
    assert before

    r = httpx.delete(f"{s.url}/v1/sessions/a", headers={"Authorization": "Bearer key-keep"}, timeout=30)
    assert r.status_code == 200
    # what only "a" named goes; the pieces "b" names (the shared system prompt) stay
    b_manifest = next((blobs / "keep" / "b").glob("*.manifest")).read_text()

    def only_b_left() -> bool:
        names = {p.name.rsplit(".", 1)[0] for p in _files(chunks)}
        return not (blobs / "keep" / "a").exists() and all(n in b_manifest for n in names)

    eventually("a's own chunks collected", only_b_left)
    after = {p.name for p in _files(chunks)}
    assert after and after < before  # b's pieces (the shared system prompt among them) stayed
    assert _chat(s.url, "key-keep", "b", "Task b: list the files.").status_code == 200  # b still whole

    # a tenant with an idle TTL: its session goes by itself, every stored byte with it
    assert _chat(s.url, "key-brief", "short", "Quick question.").status_code == 200
    eventually("short durable", lambda: _durable(s.url, "key-brief", "short"))
    eventually(
        "idle session expired",
        lambda: (
            httpx.get(
                f"{s.url}/v1/sessions/short", headers={"Authorization": "Bearer key-brief"}, timeout=5
            ).status_code
            == 404
            and not _files(blobs / "brief" / "short")
        ),
        timeout_s=60,
    )
    eventually(
        "its chunks collected", lambda: not [p for p in _files(blobs / "brief") if p.suffix in (".kv", ".ck")]
    )
    assert _durable(s.url, "key-keep", "b")  # the other tenant's session is untouched


def test_the_stored_bytes_quota_counts_unique_bytes(serve: Any, tmp_path: Path) -> None:
    """Six sessions sharing a system prompt fit a quota of three full saves: the shared chunks
    count once. (Counting each session's full state, the fourth would be refused.)"""
    probe = tmp_path / "probe"
    s = serve(probe)
    assert _chat(s.url, "none", "s0", "Task 0.").status_code == 200
    eventually("s0 durable", lambda: _durable(s.url, "none", "s0"))
    manifest = next((probe / "blobs" / "slotkeeper" / "default" / "s0").glob("*.manifest"))
    full = int(json.loads(manifest.read_text())["plan"]["size"])

    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.t]\nkeys = ["key-t"]\n[tenants.t.quotas]\nstored_bytes = {3 * full}\n')
    data = tmp_path / "data"
    s = serve(data, tenants=tenants)
    for i in range(6):
        assert _chat(s.url, "key-t", f"s{i}", f"Task {i}.").status_code == 200, i
        eventually(f"s{i} durable", lambda x=i: _durable(s.url, "key-t", f"s{x}"))
    stored = sum(p.stat().st_size for p in _files(data / "blobs" / "slotkeeper" / "t"))
    assert stored < 3 * full
    # and the quota is enforced on those bytes: a tenant over it gets no new session
    tenants.write_text('[tenants.t]\nkeys = ["key-t"]\n[tenants.t.quotas]\nstored_bytes = 1\n')
    s.stop()
    s = serve(data, tenants=tenants)
    r = _chat(s.url, "key-t", "s9", "Task 9.")
    assert r.status_code == 429 and "stores" in r.json()["error"]["message"]
    assert _chat(s.url, "key-t", "s1", "Task 1, again.").status_code == 200  # its sessions still work


def test_a_tenant_that_does_not_share_keeps_each_sessions_chunks(serve: Any, tmp_path: Path) -> None:
    tenants = _tenants(tmp_path, "open", "apart", "share_chunks = false")
    data = tmp_path / "data"
    s = serve(data, tenants=tenants)
    for key in ("key-open", "key-apart"):
        for session in ("x", "y"):  # the same system prompt in both sessions
            assert _chat(s.url, key, session, f"Task {session}.").status_code == 200
            eventually(f"{session} durable", lambda k=key, x=session: _durable(s.url, k, x))
    blobs = data / "blobs" / "slotkeeper"

    def namespaces(tenant: str) -> set[str]:
        return {p.parent.name for p in _files(blobs / tenant / ".chunks") if p.suffix == ".kv"}

    assert len(namespaces("open")) == 1  # one copy of the shared prefix for both sessions
    assert len(namespaces("apart")) == 2  # each session its own


class _HeldStore:
    """A store whose tenant collection is refused (LockBusy) while `busy`, as when saves hold on."""

    def __init__(self) -> None:
        self.busy = True
        self.tried: list[str] = []
        self.tries: asyncio.Queue[str] = asyncio.Queue()

    async def collect_unnamed(self, tenant: str) -> None:
        self.tried.append(tenant)
        self.tries.put_nowait(tenant)
        if self.busy:
            raise LockBusy(f"tenant {tenant}: saves still running after 10 s")


async def test_a_skipped_collection_is_not_tried_again_until_its_hold_off_passes() -> None:
    now = [1_000.0]
    store = _HeldStore()
    retention = Retention(store, None, None, interval_s=0, hold_off_s=30.0, clock=lambda: now[0])  # type: ignore[arg-type]

    async def next_try() -> str:
        return await asyncio.wait_for(store.tries.get(), 10)

    async def delete(tenant: Any, session: str) -> None:
        raise AssertionError("nothing expires here")

    task = asyncio.create_task(retention.run(delete))
    try:
        retention.collect_soon("acme")
        assert await next_try() == "acme"
        for _ in range(20):  # saves ask again and again: each try would hold the tenant's saves back
            retention.collect_soon("acme")
            await asyncio.sleep(0)
        assert store.tried == ["acme"]
        now[0] += 30.0
        store.busy = False
        retention.collect_soon("globex")  # any wake-up after the hold-off tries it again
        assert {await next_try(), await next_try()} == {"acme", "globex"}
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

"""storage.index.reindex: Redis loses everything, storage (local or S3) brings every session back."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from storage.blobs.blobstore import BlobStore
from storage.blobs.localstore import LocalStore
from storage.blobs.s3client import make_s3_client
from storage.blobs.s3store import S3Store
from storage.errors import StorageError
from storage.ids import SlotRef
from storage.index.prefix_digests import join_routes, split_routes
from storage.index.reindex import main, reindex, reindex_session
from storage.index.session_index import SessionIndex, SessionState


@pytest.fixture(params=["local", "moto"])
async def store(request: pytest.FixtureRequest, tmp_path: Path, key_prefix: str) -> AsyncIterator[BlobStore]:
    if request.param == "local":
        yield LocalStore(tmp_path / "store", prefix=key_prefix, fsync=False)
        return
    client = make_s3_client(
        endpoint_url=request.getfixturevalue("s3_endpoint_for")("moto"), access_key="t", secret_key="t"
    )
    async with S3Store(client, "slots", prefix=key_prefix) as s3:
        yield s3
    client.close()


async def populate(
    store: BlobStore, index: SessionIndex, tmp_path: Path, writer: Any
) -> dict[tuple[str, str], int]:
    """Sessions of two tenants, several generations each, spilled in the index; returns the newest."""
    latest = {}
    for tenant, session, generations in (
        ("acme", "s1", [1, 2, 5]),
        ("acme", "s2", [3]),
        ("beta", "s1", [1, 7]),
    ):
        await index.create(tenant, session, model="fp")
        for gen in generations:
            src = writer.write(tmp_path / f"{tenant}-{session}-{gen}.slot", writer.Spec(n_tokens=gen + 1))
            meta = await store.put_file(
                SlotRef(tenant, session, gen), src, model=f"fp{gen}", n_tokens=gen + 1
            )
            await index.mark_spilled(tenant, session, generation=gen, blob_key=meta.key, nbytes=meta.size)
        latest[(tenant, session)] = generations[-1]
    return latest


async def test_flushed_redis_is_rebuilt(
    store: BlobStore, redis_client: Any, tmp_path: Path, slot_writer: Any
) -> None:
    index = SessionIndex(redis_client, prefix="sk")
    latest = await populate(store, index, tmp_path, slot_writer)
    before = {k: await index.get(*k) for k in latest}
    await redis_client.flushdb()
    assert await index.find("acme", "s1") is None
    dry = await reindex(store, index, dry_run=True)
    assert dry.restored == 3 and await index.find("acme", "s1") is None
    report = await reindex(store, index)
    assert (report.tenants, report.sessions, report.restored, report.skipped) == (2, 3, 3, [])
    for (tenant, session), gen in latest.items():
        got = await index.get(tenant, session)
        old = before[(tenant, session)]
        assert got.state is SessionState.SPILLED
        assert (got.generation, got.blob_key, got.bytes) == (gen, old.blob_key, old.bytes)
        assert (got.model, got.tokens) == (f"fp{gen}", gen + 1)
    again = await reindex(store, index)
    assert (again.restored, again.unchanged) == (0, 3)
    assert await index.list_sessions("acme") and await index.list_sessions("beta")
    for tenant in ("acme", "beta"):  # the stored-bytes counter is what the store holds
        newest = [b for (t, _), b in ((k, v.bytes) for k, v in before.items()) if t == tenant]
        assert await index.stored_bytes(tenant) == await store.stored_bytes(tenant) >= sum(newest) > 0
        assert await index.count_sessions(tenant) == len(newest)


async def test_one_session_is_found_again_in_the_store(
    store: BlobStore, redis_client: Any, tmp_path: Path, slot_writer: Any
) -> None:
    """What a turn does while a lost index heals: its own session, from the store, before the rest."""
    index = SessionIndex(redis_client, prefix="sk")
    latest = await populate(store, index, tmp_path, slot_writer)
    await redis_client.flushdb()
    assert await reindex_session(store, index, "acme", "s1")
    got = await index.get("acme", "s1")
    assert (got.state, got.generation, got.tokens) == (SessionState.SPILLED, latest[("acme", "s1")], 6)
    assert await index.find("acme", "s2") is None  # only the one asked for
    assert not await reindex_session(store, index, "acme", "s1")  # known now: nothing to learn
    assert not await reindex_session(store, index, "acme", "never-stored")
    assert await index.find("acme", "never-stored") is None


async def test_live_sessions_stay_live(
    store: BlobStore, redis_client: Any, tmp_path: Path, slot_writer: Any
) -> None:
    index = SessionIndex(redis_client, prefix="sk")
    await populate(store, index, tmp_path, slot_writer)
    await index.mark_live("acme", "s2", engine="e1", slot=0, tokens=50)
    src = slot_writer.write(tmp_path / "newer.slot", slot_writer.Spec())
    await store.put_file(SlotRef("acme", "s2", 4), src, model="fp", n_tokens=6)  # write-behind landed
    report = await reindex(store, index, tenants=["acme"])
    assert (report.tenants, report.restored) == (1, 1)
    got = await index.get("acme", "s2")
    assert (got.state, got.engine, got.generation) == (SessionState.LIVE, "e1", 4)


async def test_reindex_recounts_stored_bytes_and_skips_deleted_leftovers(
    store: BlobStore, redis_client: Any, tmp_path: Path, slot_writer: Any
) -> None:
    index = SessionIndex(redis_client, prefix="sk")
    await populate(store, index, tmp_path, slot_writer)
    await redis_client.set(index.keys.stored_bytes("acme"), 1)  # drifted
    await index.delete("acme", "s2")  # its generation 3 stays in the store (a delete that failed half-way)
    report = await reindex(store, index, tenants=["acme"])
    assert report.restored == 0 and await index.find("acme", "s2") is None
    # what the store holds, leftovers included (they are bytes the tenant occupies until deleted)
    assert await index.stored_bytes("acme") == await store.stored_bytes("acme") > 1


async def test_unusable_metadata_is_skipped(tmp_path: Path, redis_client: Any, slot_writer: Any) -> None:
    store = LocalStore(tmp_path / "store", fsync=False)
    index = SessionIndex(redis_client, prefix="sk")
    src = slot_writer.write(tmp_path / "a.slot", slot_writer.Spec())
    meta = await store.put_file(SlotRef("acme", "s", 1), src, model="fp", n_tokens=6)
    (tmp_path / "store" / f"{meta.key}.meta.json").write_text(json.dumps({"tenant": "evil", "checksum": "x"}))
    report = await reindex(store, index)
    assert report.skipped == [meta.key] and await index.find("acme", "s") is None


async def test_cli(
    tmp_path: Path, redis_port: int, slot_writer: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    store = LocalStore(tmp_path / "store", prefix="p", fsync=False)
    src = slot_writer.write(tmp_path / "a.slot", slot_writer.Spec())
    await store.put_file(SlotRef("acme", "cli", 3), src, model="fp", n_tokens=6)
    url = f"redis://127.0.0.1:{redis_port}/5"
    argv = ["--local", str(tmp_path / "store"), "--prefix", "p", "--redis", url, "--redis-prefix", "cli"]
    # main() runs its own event loop, so it must run outside this test's loop
    rc = await asyncio.to_thread(main, [*argv, "--json"])
    out = json.loads(capsys.readouterr().out.splitlines()[-1])  # unconfigured structlog logs to stdout
    assert rc == 0 and out["restored"] == 1 and out["sessions"] == 1
    rc = await asyncio.to_thread(main, argv)
    assert rc == 0 and "unchanged 1" in capsys.readouterr().out.splitlines()[-1]
    with pytest.raises(SystemExit):
        main(["--s3-endpoint", "http://127.0.0.1:1", "--redis", url])  # no --bucket


async def test_routing_digest_travels_with_the_object(
    store: BlobStore, redis_client: Any, tmp_path: Path, slot_writer: Any
) -> None:
    index = SessionIndex(redis_client, prefix="sk")
    route = "ab" * 16
    src = slot_writer.write(tmp_path / "r.slot", slot_writer.Spec(n_tokens=3))
    meta = await store.put_file(SlotRef("acme", "routed", 1), src, model="fp", n_tokens=3, route=route)
    assert meta.route == route and (await store.head(SlotRef("acme", "routed", 1))).route == route
    await reindex(store, index)
    assert (await index.get("acme", "routed")).route == route
    assert await index.match_prefix("acme", [route]) == (route, "routed")
    with pytest.raises(StorageError, match="route"):
        await store.put_file(SlotRef("acme", "routed", 2), src, model="fp", n_tokens=3, route="NOT-HEX")


async def test_the_shared_prefix_digest_travels_beside_the_route(
    store: BlobStore, redis_client: Any, tmp_path: Path, slot_writer: Any
) -> None:
    """A new session finds the newest stored session of its shared prefix after the index was lost."""
    index = SessionIndex(redis_client, prefix="sk")
    route, shared = "ab" * 16, "cd" * 16
    src = slot_writer.write(tmp_path / "r.slot", slot_writer.Spec(n_tokens=3))
    for session in ("older", "newer"):
        stored = join_routes(route if session == "older" else "ef" * 16, shared)
        await store.put_file(SlotRef("acme", session, 1), src, model="fp", n_tokens=3, route=stored)
        await asyncio.sleep(1.1)  # (the newer one is modified later: S3 stamps whole seconds)
    await store.put_file(SlotRef("acme", "alone", 1), src, model="fp", n_tokens=3, route="12" * 16)
    await reindex(store, index)
    older = await index.get("acme", "older")
    assert (older.route, older.shared) == (route, shared)
    assert older.stored_routes == f"{route}.{shared}"
    assert await index.match_prefix("acme", [route]) == (route, "older")
    found = await index.find_shared("acme", shared)
    assert found is not None and found.session == "newer"
    assert (await index.get("acme", "alone")).shared == ""
    with pytest.raises(StorageError, match="route"):
        await store.put_file(
            SlotRef("acme", "bad", 1), src, model="fp", n_tokens=3, route=f"{route}.{shared}.x"
        )


async def test_the_last_prompts_digest_travels_beside_the_route_too(
    store: BlobStore, redis_client: Any, tmp_path: Path, slot_writer: Any
) -> None:
    """A prompt sent again finds the session that served it after the index was lost; a stored form
    without the prompt's digest (written before it was recorded) reads as before."""
    index = SessionIndex(redis_client, prefix="sk")
    route, shared, prompt = "ab" * 16, "cd" * 16, "ef" * 16
    src = slot_writer.write(tmp_path / "r.slot", slot_writer.Spec(n_tokens=3))
    await store.put_file(
        SlotRef("acme", "both", 1), src, model="fp", n_tokens=3, route=join_routes(route, shared, prompt)
    )
    await store.put_file(
        SlotRef("acme", "no-shared", 1),
        src,
        model="fp",
        n_tokens=3,
        route=join_routes("12" * 16, "", "34" * 16),
    )
    await reindex(store, index)
    both = await index.get("acme", "both")
    assert (both.route, both.shared, both.prompt) == (route, shared, prompt)
    assert both.stored_routes == f"{route}.{shared}+{prompt}"
    for digest, session in ((prompt, "both"), (shared, "both"), ("34" * 16, "no-shared")):
        found = await index.find_shared("acme", digest)
        assert found is not None and found.session == session
    assert split_routes(f"{route}.{shared}") == (route, shared, "", "")  # the form stored before
    head = "56" * 16
    assert split_routes(join_routes(route, shared, prompt, head)) == (route, shared, prompt, head)
    assert split_routes(join_routes(route, "", "", head)) == (route, "", "", head)
    assert join_routes("", shared, prompt) == ""  # nothing without a route
    with pytest.raises(StorageError, match="route"):
        bad = f"{route}+{shared}+x"
        await store.put_file(SlotRef("acme", "bad", 1), src, model="fp", n_tokens=3, route=bad)

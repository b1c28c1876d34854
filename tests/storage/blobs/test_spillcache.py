"""storage.blobs.spillcache: recency, byte budget, and never evicting what the store does not hold."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from storage.blobs.localstore import LocalStore
from storage.blobs.retry import RetryPolicy
from storage.blobs.s3client import make_s3_client
from storage.blobs.s3store import S3Store
from storage.blobs.spillcache import SpillCache
from storage.errors import StoreUnavailable, WriteConflict
from storage.ids import SlotRef


def make(tmp_path: Path, writer: Any, name: str, state_size: int = 1000) -> Path:
    return writer.write(tmp_path / name, writer.Spec(state_size=state_size))


def clock() -> Any:
    ticks = itertools.count(1)
    return lambda: float(next(ticks))


async def test_lru_under_budget_skips_unconfirmed_and_pinned(tmp_path: Path, slot_writer: Any) -> None:
    size = make(tmp_path, slot_writer, "probe.slot").stat().st_size
    cache = SpillCache(tmp_path / "cache", max_bytes=3 * size, clock=clock())
    refs = [SlotRef("acme", f"s{i}", 1) for i in range(5)]
    for i, ref in enumerate(refs[:3]):
        await cache.add(ref, make(tmp_path, slot_writer, f"{i}.slot"))
    assert cache.total_bytes == 3 * size and not (tmp_path / "0.slot").exists()  # moved in
    await cache.mark_uploaded(refs[1])
    await cache.mark_uploaded(refs[2])
    cache.pin(refs[1])
    await cache.get(refs[2])  # refs[2] is now the most recent
    with capture_logs() as logs:
        await cache.add(refs[3], make(tmp_path, slot_writer, "3.slot"))
    # refs[0] is oldest but unconfirmed, refs[1] is pinned: refs[2] goes although it was used last
    assert refs[0] in cache and refs[1] in cache and refs[2] not in cache and refs[3] in cache
    assert [e["session"] for e in logs if e["event"] == "spill.evict"] == ["s2"]
    with capture_logs() as logs:
        await cache.add(refs[4], make(tmp_path, slot_writer, "4.slot"))
    assert cache.total_bytes == 4 * size and "spill.over_budget" in [e["event"] for e in logs]
    cache.unpin(refs[1])
    assert await cache.evict() == [refs[1]]
    assert cache.pending() == [refs[0], refs[3], refs[4]]


async def test_state_survives_restart(tmp_path: Path, slot_writer: Any) -> None:
    cache = SpillCache(tmp_path / "c", max_bytes=1 << 30)
    a, b = SlotRef("acme", "a", 1), SlotRef("acme", "b", 2)
    await cache.add(a, make(tmp_path, slot_writer, "a.slot"))
    await cache.add(b, make(tmp_path, slot_writer, "b.slot"))
    await cache.mark_uploaded(b)
    (cache.path_for(a).parent / ".00000000000000000009.slot.x.part").write_bytes(b"junk")
    again = await SpillCache.open(tmp_path / "c", max_bytes=0)
    assert again.pending() == [a] and again.is_uploaded(b)
    assert await again.evict() == [b]  # budget 0: only the confirmed file may go
    assert a in again and not list(cache.path_for(a).parent.glob("*.part"))


async def test_flush_to_store_then_fill(tmp_path: Path, slot_writer: Any) -> None:
    store = LocalStore(tmp_path / "store", fsync=False)
    cache = SpillCache(tmp_path / "c", max_bytes=0)
    ref = SlotRef("acme", "a", 1)
    src = make(tmp_path, slot_writer, "a.slot")
    original = src.read_bytes()
    await cache.add(ref, src)
    assert await cache.flush(store) == [ref]
    head = await store.head(ref)
    assert head.n_tokens == 6 and head.model == "ab" * 32
    assert ref not in cache  # confirmed, so evicted at once under a zero budget
    path = await cache.fill(store, ref)
    assert path.read_bytes() == original and cache.is_uploaded(ref)
    assert await cache.fill(store, ref) == path  # pinned twice now
    cache.unpin(ref)
    assert await cache.evict() == []
    cache.unpin(ref)
    assert await cache.evict() == [ref] and not path.exists()


async def test_flush_confirms_an_upload_whose_confirmation_was_lost(tmp_path: Path, slot_writer: Any) -> None:
    store = LocalStore(tmp_path / "store", fsync=False)
    cache = SpillCache(tmp_path / "c", max_bytes=1 << 30)
    ref = SlotRef("acme", "a", 1)
    path = await cache.add(ref, make(tmp_path, slot_writer, "a.slot"))
    await store.put_file(ref, path, model="m", n_tokens=6)  # uploaded, then "crashed" before marking
    assert await cache.flush(store) == [ref] and cache.is_uploaded(ref)
    other = SlotRef("acme", "b", 1)
    await store.put_file(other, make(tmp_path, slot_writer, "x.slot", 999), model="m", n_tokens=6)
    await cache.add(other, make(tmp_path, slot_writer, "b.slot"))
    with pytest.raises(WriteConflict):
        await cache.flush(store)  # a different object holds that generation
    assert cache.pending() == [other]


async def test_store_down_keeps_files_until_confirmed(
    restartable_moto: Any, tmp_path: Path, slot_writer: Any
) -> None:
    client = make_s3_client(
        endpoint_url=restartable_moto.endpoint, access_key="t", secret_key="t", connect_timeout_s=1
    )
    retry = RetryPolicy(attempts=2, base_s=0.05, max_s=0.05)
    store = S3Store(client, "slots", prefix="p", retry=retry, conditional_writes="native")
    cache = SpillCache(tmp_path / "c", max_bytes=0)
    refs = [SlotRef("acme", f"s{i}", 1) for i in range(2)]
    for i, ref in enumerate(refs):
        await cache.add(ref, make(tmp_path, slot_writer, f"{i}.slot"))
    restartable_moto.kill()
    with pytest.raises(StoreUnavailable):
        await cache.flush(store)
    assert await cache.evict() == [] and cache.pending() == refs
    assert all(cache.path_for(r).exists() for r in refs)
    restartable_moto.start()
    assert await cache.flush(store) == refs
    assert cache.total_bytes == 0 and [i.ref async for i in store.list("acme")] == refs
    await store.aclose()
    client.close()


async def test_session_refs_lists_every_cached_generation_of_one_session(
    tmp_path: Path, slot_writer: Any
) -> None:
    cache = SpillCache(tmp_path / "cache", max_bytes=1 << 30, clock=clock())
    refs = [
        SlotRef("acme", "s", 3),
        SlotRef("acme", "s", 1),
        SlotRef("acme", "t", 1),
        SlotRef("beta", "s", 1),
    ]
    for i, ref in enumerate(refs):
        await cache.add(ref, make(tmp_path, slot_writer, f"{i}.slot"), uploaded=i == 1)
    cache.pin(refs[0])
    assert cache.session_refs("acme", "s") == [SlotRef("acme", "s", 1), SlotRef("acme", "s", 3)]
    for ref in cache.session_refs("acme", "s"):  # what a node does when the session is deleted
        await cache.discard(ref)
    assert cache.session_refs("acme", "s") == [] and not (tmp_path / "cache" / "acme" / "s").exists()
    assert cache.session_refs("acme", "t") == [SlotRef("acme", "t", 1)]
    reopened = await SpillCache.open(tmp_path / "cache", max_bytes=1 << 30)
    assert reopened.session_refs("beta", "s") == [SlotRef("beta", "s", 1)]


async def test_a_file_its_adder_uploads_is_left_to_it_until_that_ends(
    tmp_path: Path, slot_writer: Any
) -> None:
    store = LocalStore(tmp_path / "store", fsync=False)
    cache = SpillCache(tmp_path / "c", max_bytes=1 << 30)
    mine, theirs, later = SlotRef("acme", "a", 1), SlotRef("acme", "b", 1), SlotRef("acme", "c", 1)
    await cache.add(mine, make(tmp_path, slot_writer, "a.slot"), pin=True, uploading=True)
    await cache.add(theirs, make(tmp_path, slot_writer, "b.slot"))
    assert cache.pending() == [theirs]
    assert await cache.flush(store) == [theirs]  # not the file being uploaded by its adder
    assert [i.ref async for i in store.list("acme")] == [theirs]
    cache.upload_ended(mine)  # its upload failed or was deferred: the flush's now
    assert cache.pending() == [mine]
    assert await cache.flush(store) == [mine] and cache.is_uploaded(mine)
    await cache.add(later, make(tmp_path, slot_writer, "c.slot"), uploading=True)
    await cache.mark_uploaded(later)  # its adder's upload worked
    cache.upload_ended(later)
    assert cache.pending() == [] and cache.is_uploaded(later)


class _Claimed(LocalStore):
    """A store where one generation is claimed by a writer still at work: a second put of it is a
    WriteConflict and its object is not visible yet, as a chunked store shows it mid-save."""

    def __init__(self, root: Path, busy: SlotRef) -> None:
        super().__init__(root, fsync=False)
        self.busy: SlotRef | None = busy

    async def put_file(self, ref: SlotRef, *args: Any, **kwargs: Any) -> Any:
        if ref == self.busy:
            raise WriteConflict(f"generation {ref.generation} of session {ref.session} is being stored")
        return await super().put_file(ref, *args, **kwargs)


async def test_flush_leaves_a_generation_another_writer_is_storing_pending(
    tmp_path: Path, slot_writer: Any
) -> None:
    busy, other = SlotRef("acme", "a", 1), SlotRef("acme", "b", 1)
    store = _Claimed(tmp_path / "store", busy)
    cache = SpillCache(tmp_path / "c", max_bytes=1 << 30)
    path = await cache.add(busy, make(tmp_path, slot_writer, "a.slot"))
    await cache.add(other, make(tmp_path, slot_writer, "b.slot"))
    with capture_logs() as logs:
        assert await cache.flush(store) == [other]  # the rest is flushed all the same
    assert cache.pending() == [busy]
    assert [e["why"] for e in logs if e["event"] == "spill.flush_later"] == ["being stored"]
    store.busy = None  # the other writer finished: its object is these bytes
    await LocalStore.put_file(store, busy, path, model="m", n_tokens=6)
    assert await cache.flush(store) == [busy] and cache.is_uploaded(busy)

"""storage.blobs.localstore specifics (the shared contract is in test_blobstore.py)."""

from __future__ import annotations

import asyncio
import errno
import json
import mmap
import os
from pathlib import Path
from typing import Any

import pytest

from storage.blobs.localstore import LocalStore
from storage.errors import NotStored, StorageError, WriteConflict
from storage.ids import SlotRef


async def test_layout_and_sidecar(tmp_path: Path, slot_writer: Any) -> None:
    store = LocalStore(tmp_path, prefix="p/q")
    src = slot_writer.write(tmp_path / "a.slot", slot_writer.Spec(state_size=20 << 20))
    meta = await store.put_file(SlotRef("acme", "s", 1), src, model="fp", n_tokens=6)
    path = tmp_path / "p/q/acme/s/00000000000000000001.slot"
    assert path.read_bytes() == src.read_bytes()
    sidecar = json.loads(path.with_name(path.name + ".meta.json").read_text())
    assert (
        sidecar["checksum"] == meta.checksum
        and sidecar["tokens"] == "6"
        and sidecar["size"] == str(meta.size)
    )
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, f"{path.name}.meta.json"]
    await store.aclose()


async def test_claimed_but_uncommitted_generation(tmp_path: Path, slot_writer: Any) -> None:
    """A crash between the link (claim) and the metadata rename (commit): invisible, not reusable."""
    store = LocalStore(tmp_path, fsync=False)
    ref = SlotRef("acme", "s", 1)
    path = tmp_path / store.key_for(ref)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"half")
    with pytest.raises(NotStored):
        await store.head(ref)
    assert [i async for i in store.list("acme")] == []
    with pytest.raises(WriteConflict):
        await store.put_file(
            ref, slot_writer.write(tmp_path / "a.slot", slot_writer.Spec()), model="m", n_tokens=1
        )


async def test_unreadable_metadata(tmp_path: Path, slot_writer: Any) -> None:
    store = LocalStore(tmp_path, fsync=False)
    ref = SlotRef("acme", "s", 1)
    meta = await store.put_file(
        ref, slot_writer.write(tmp_path / "a.slot", slot_writer.Spec()), model="m", n_tokens=1
    )
    (tmp_path / f"{meta.key}.meta.json").write_text("{not json")
    with pytest.raises(StorageError):
        await store.head(ref)
    with pytest.raises(ValueError):
        LocalStore(tmp_path, concurrency=0)


async def test_a_viewed_object_keeps_its_bytes_through_replace_and_delete(tmp_path: Path) -> None:
    """What a restore reads as a map stays what it mapped: pieces are replaced by rename and
    collected by unlink, never written in place."""
    store = LocalStore(tmp_path, prefix="p", fsync=False)
    key = "p/acme/.chunks/ns/abc-00000000.ck"
    await store.put_object(key, b"first bytes " * 1000)
    view = await store.view_object(key)
    assert bytes(view) == await store.get_object(key) and view[:5] == b"first"
    await store.put_object(key, b"other bytes " * 10)  # replaced meanwhile
    await store.delete_object(key)  # and collected
    assert bytes(view[:12]) == b"first bytes " and len(view) == 12_000
    with pytest.raises(NotStored):
        await store.view_object(key)
    await store.put_object("p/acme/empty", b"")
    assert await store.view_object("p/acme/empty") == b""


async def test_a_restores_pieces_are_viewed_together_in_order(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, prefix="p", fsync=False)
    keys = [f"p/acme/.chunks/ns/{i}.kv" for i in range(5)]
    for i, key in enumerate(keys):
        await store.put_object(key, bytes([i]) * (i + 1) * 100)
    await store.put_object("p/acme/empty", b"")
    views = await store.view_objects([*reversed(keys), "p/acme/empty"], asyncio.Semaphore(1))
    assert [bytes(v) for v in views] == [await store.get_object(k) for k in reversed(keys)] + [b""]
    with pytest.raises(NotStored, match="missing"):
        await store.view_objects([keys[0], "p/acme/missing"], asyncio.Semaphore(1))


@pytest.mark.parametrize("errno_", [errno.EMFILE, errno.ENOMEM])
async def test_a_piece_that_cannot_be_mapped_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, errno_: int
) -> None:
    """Each map keeps a descriptor: a process out of them (or of maps) reads the piece instead."""
    store = LocalStore(tmp_path, prefix="p", fsync=False)
    await store.put_object("p/acme/piece", b"bytes " * 100)

    def refuse(*_: Any, **__: Any) -> None:
        raise OSError(errno_, os.strerror(errno_))

    monkeypatch.setattr(mmap, "mmap", refuse)
    assert await store.view_object("p/acme/piece") == b"bytes " * 100

"""storage.chunks.chunkstore.ChunkedStore's restores over a LocalStore and a real S3 server, fed slot
files written by the real native engine: a generation with KV pieces is written as its pieces
arrive, a window at a time, into the places its plan gives them (what a restore holds is a window
or two, not the state), the bytes are the original's, and a damaged, missing or misdescribed piece —
also in the middle of such a restore — fails it with the piece named, the destination untouched."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from support.chunks import (
    PREFIX,
    Faulty,
    Slots,
    make_ledger,
    put,
    restores,
    same_bytes,
    split_of,
)

from storage.blobs.s3client import make_s3_client
from storage.blobs.s3store import S3Store
from storage.chunks.assembly import PlacedFile
from storage.chunks.chunking import objects_needed
from storage.chunks.chunkstore import ChunkedStore
from storage.errors import (
    ChecksumError,
    SlotFileError,
    StorageError,
)
from storage.fetch_progress import watched
from storage.ids import SlotRef, piece_key
from storage.slotfile.reader import read_slot_file, whole_file_crc32


# ------------------------------------------------------------------------------------- restore paths
def _rewrite_plan(inner: Faulty, ref: SlotRef, **changes: Any) -> dict[str, Any]:
    """Change the stored manifest's plan: a value of None drops the field."""
    path = inner.root / PREFIX / ref.tenant / ref.session / f"{ref.generation:020d}.manifest"
    doc = json.loads(path.read_bytes())
    for key, value in changes.items():
        if value is None:
            doc["plan"].pop(key, None)
        else:
            doc["plan"][key] = value
    path.write_bytes(json.dumps(doc).encode())
    plan: dict[str, Any] = doc["plan"]
    return plan


@pytest.mark.parametrize("which", ["grow4", "branch", "rec1"])
async def test_a_restore_writes_kv_pieces_as_they_arrive(
    store: ChunkedStore,
    inner: Faulty,
    slots: Slots,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    which: str,
) -> None:
    """A generation with KV pieces is written a window of pieces at a time while the next windows
    are fetched: the pieces asked for and not yet written are at most three windows (of one piece
    here), never the state, and the bytes are the original's — checked, and unverified (as a node
    restores: the engine checks them). A recurrent model's state is in its tail and checkpoints."""
    src = {"grow4": slots.grow[4], "branch": slots.branch, "rec1": slots.recurrent[1]}[which]
    monkeypatch.setattr(inner, "window_bytes", 1)
    lock, flight = threading.Lock(), {"now": 0, "most": 0, "asked": 0}

    async def asked(key: str) -> None:
        if key.endswith(".kv"):
            with lock:
                flight["now"] += 1
                flight["asked"] += 1
                flight["most"] = max(flight["most"], flight["now"])

    place = PlacedFile.place_window

    def placed(self: PlacedFile, first: int, pieces: Sequence[tuple[bytes, str, int]], verify: bool) -> None:
        place(self, first, pieces, verify)
        with lock:
            flight["now"] -= sum(what.endswith(".kv") for _, what, _ in pieces)

    monkeypatch.setattr(PlacedFile, "place_window", placed)
    ref = SlotRef("acme", "s1", 1)
    await put(store, ref, src)
    inner.hooks["get_object"] = asked
    await restores(store, ref, src, tmp_path / "back.slot")
    meta = await store.get_to_file(ref, tmp_path / "unverified.slot", verify=False)
    assert same_bytes(tmp_path / "unverified.slot", src)
    assert (meta.size, meta.crc32) == ((await store.head(ref)).size, whole_file_crc32(src))
    n_kv = len(split_of(src).chunks)
    assert flight["asked"] == 2 * n_kv and flight["now"] == 0
    if which == "rec1":
        assert n_kv == 0
    else:
        assert flight["most"] <= 3 < n_kv  # the window written and the two coming


async def test_a_manifest_without_body_crc_restores_with_the_trailer_written_last(
    store: ChunkedStore, inner: Faulty, slots: Slots, tmp_path: Path
) -> None:
    """Manifests written before the body CRC (and the bounds) were recorded: the restore writes
    the body, computes its CRC meanwhile and writes the trailer last, whether asked to verify or
    not, and gives back exactly the original bytes."""
    refs = [(SlotRef("acme", "s1", 1), slots.grow[3]), (SlotRef("acme", "r1", 1), slots.recurrent[1])]
    for ref, src in refs:
        await put(store, ref, src)
        plan = _rewrite_plan(inner, ref, body_crc32=None, bounds=None)
        assert "body_crc32" not in plan and "bounds" not in plan
    for ref, src in refs:
        await restores(store, ref, src, tmp_path / f"{ref.session}.slot")
        await store.get_to_file(ref, tmp_path / f"{ref.session}.unverified", verify=False)
        assert same_bytes(tmp_path / f"{ref.session}.unverified", src)
        assert (await store.head(ref)).crc32 == whole_file_crc32(src)
    # and a damaged piece is still named on that path
    victim = sorted(inner.root.rglob("*.kv"))[0]
    _flip(victim, victim.stat().st_size // 2)
    with pytest.raises(ChecksumError, match=victim.name):
        await store.get_to_file(refs[0][0], tmp_path / "bad.slot")
    assert not (tmp_path / "bad.slot").exists()


async def test_a_wrong_body_crc_in_a_manifest_is_not_restored(
    store: ChunkedStore, inner: Faulty, slots: Slots, tmp_path: Path
) -> None:
    src, ref = slots.grow[3], SlotRef("acme", "s1", 1)
    await put(store, ref, src)
    good = read_slot_file(src).body_crc32
    _rewrite_plan(inner, ref, body_crc32=good ^ 1)
    dest = tmp_path / "dest.slot"
    try:
        await store.get_to_file(ref, dest)
    except (ChecksumError, SlotFileError):
        assert not dest.exists()  # refused: what the restore promises
        return
    assert read_slot_file(dest).checksum_ok, "restored a file whose body CRC is wrong"
    assert same_bytes(dest, src)


# ------------------------------------------------------------------------------------ damaged objects
def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("window", ["one piece", "all"])
@pytest.mark.parametrize(
    "where", ["kv-start", "kv-middle", "kv-end", "ck-middle", "tail-data", "kv-truncated"]
)
async def test_a_damaged_piece_fails_the_restore_and_leaves_dest_alone(
    store: ChunkedStore,
    inner: Faulty,
    slots: Slots,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    where: str,
    window: str,
) -> None:
    """Damage anywhere, also in a KV piece in the middle of a restore that writes its pieces one
    window at a time (the ones before it already written): the restore fails, the destination
    stays as it was and no temporary file is left."""
    if window == "one piece":
        monkeypatch.setattr(inner, "window_bytes", 1)
    ref = SlotRef("acme", "s1", 1)
    await put(store, ref, slots.grow[3])
    kind, at = where.split("-")
    if kind == "tail":
        target = inner.root / PREFIX / "acme" / "s1" / f"{1:020d}.tail"
    elif kind == "kv":
        chunks = _rewrite_plan(inner, ref)["chunks"]
        assert len(chunks) > 2
        target = next(inner.root.rglob(f"{chunks[len(chunks) // 2][0]}.kv"))
    else:
        target = sorted(inner.root.rglob(f"*.{kind}"))[0]
    size = target.stat().st_size
    if at == "truncated":
        target.write_bytes(target.read_bytes()[:-1])
    else:
        _flip(target, {"start": 0, "middle": size // 2, "end": size - 1, "data": size // 2}[at])
    dest = tmp_path / "out" / "dest.slot"
    dest.parent.mkdir()
    dest.write_bytes(b"the previous file")
    with pytest.raises(ChecksumError):
        await store.get_to_file(ref, dest)
    assert dest.read_bytes() == b"the previous file"
    assert sorted(p.name for p in dest.parent.iterdir()) == ["dest.slot"]  # no temporary left
    # unverified (the engine checks as it loads): refused now, or written with the original's
    # CRC in its trailer, which the bytes then fail (the engine refuses them: never a wrong state)
    try:
        await store.get_to_file(ref, dest, verify=False)
    except (ChecksumError, SlotFileError):
        assert dest.read_bytes() == b"the previous file"
    else:
        assert not read_slot_file(dest).checksum_ok


@pytest.mark.parametrize("offset", [0, 4])
async def test_a_damaged_tail_header_is_a_checksum_error(
    store: ChunkedStore, inner: Faulty, slots: Slots, tmp_path: Path, offset: int
) -> None:
    """Damage in a tail's framing makes the assembly fail; the tail's name carries its CRC, so the
    restore names the damaged object with a storage ChecksumError (not a slot-file parse error)."""
    ref = SlotRef("acme", "s1", 1)
    await put(store, ref, slots.grow[3])
    _flip(inner.root / PREFIX / "acme" / "s1" / f"{1:020d}.tail", offset)
    with pytest.raises(ChecksumError):
        await store.get_to_file(ref, tmp_path / "dest.slot")


async def test_a_missing_piece_or_damaged_manifest_fails_the_restore(
    store: ChunkedStore, inner: Faulty, slots: Slots, tmp_path: Path
) -> None:
    ref = SlotRef("acme", "s1", 1)
    await put(store, ref, slots.grow[3])
    dest = tmp_path / "dest.slot"
    dest.write_bytes(b"old")
    manifest = inner.root / PREFIX / "acme" / "s1" / f"{1:020d}.manifest"
    good = manifest.read_bytes()
    for bad in (
        b"{",
        b"[]",
        json.dumps({**json.loads(good), "generation": 2}).encode(),
        json.dumps({**json.loads(good), "format": "other"}).encode(),
        json.dumps({**json.loads(good), "plan": {}}).encode(),
    ):
        manifest.write_bytes(bad)
        with pytest.raises(SlotFileError):
            await store.get_to_file(ref, dest)
        with pytest.raises(SlotFileError):
            await store.head(ref)
    manifest.write_bytes(good)
    sorted(inner.root.rglob("*.kv"))[0].unlink()
    with pytest.raises(StorageError):
        await store.get_to_file(ref, dest)
    assert dest.read_bytes() == b"old"


async def test_a_manifest_is_read_once_in_one_read(
    store: ChunkedStore, inner: Faulty, slots: Slots, tmp_path: Path
) -> None:
    """What a node's fill asks of a generation — its size, whether the prompt shares its start, its
    cut, the whole file — reads the manifest from the store once in a `one_read` block, once per
    call outside one; a later block reads it again (it holds nothing past its end)."""
    ref, src = SlotRef("acme", "s1", 1), slots.grow[4]
    await put(store, ref, src)
    reads: list[str] = []

    async def counted(key: str) -> None:
        if key.endswith(".manifest"):
            reads.append(key)

    inner.hooks["get_object"] = counted

    async def fill(dest: Path) -> None:
        assert (await store.head(ref)).size == src.stat().st_size
        await store.shares_prefix(ref, [1, 2, 3])
        assert await store.get_prefix_to_file(ref, tmp_path / "cut.slot", []) is None
        await store.get_to_file(ref, dest, verify=False)
        assert same_bytes(dest, src)

    await fill(tmp_path / "a.slot")
    assert len(reads) == 4
    for n in (1, 2):
        reads.clear()
        with store.one_read():
            await fill(tmp_path / f"b{n}.slot")
        assert len(reads) == 1
    reads.clear()
    await store.head(ref)
    assert len(reads) == 1


# ---------------------------------------------------------------------------------------------- S3
async def test_a_restore_from_s3_writes_pieces_as_they_arrive_and_names_a_damaged_one(
    s3_endpoint: str, key_prefix: str, redis_client: Any, slots: Slots, tmp_path: Path
) -> None:
    """Over a real S3 server, in windows of one piece: the original bytes, checked and unverified.
    A KV piece damaged in the store — the middle one of the plan, the pieces before it already
    written when it arrives — fails a checked restore naming it and leaves nothing behind; an
    unverified one writes a file whose trailer's CRC its reader (the engine) refuses."""
    client = make_s3_client(endpoint_url=s3_endpoint, access_key="test", secret_key="test")
    inner = S3Store(client, "slots", prefix=key_prefix)
    inner.window_bytes = 1
    store = ChunkedStore(inner, make_ledger(redis_client))
    try:
        ref, src = SlotRef("acme", "s1", 1), slots.grow[4]
        await put(store, ref, src)
        await restores(store, ref, src, tmp_path / "back.slot")
        await store.get_to_file(ref, tmp_path / "unverified.slot", verify=False)
        assert same_bytes(tmp_path / "unverified.slot", src)

        doc = json.loads(await inner.get_object(store.key_for(ref)))
        chunks = doc["plan"]["chunks"]
        assert len(chunks) > 4
        name = chunks[len(chunks) // 2][0]
        key = piece_key(key_prefix, "acme", doc["ns"], name, "kv")
        damaged = bytearray(await inner.get_object(key))
        damaged[len(damaged) // 2] ^= 0x40
        await inner.put_object(key, bytes(damaged))
        (tmp_path / "out").mkdir()
        with pytest.raises(ChecksumError, match=name):
            await store.get_to_file(ref, tmp_path / "out" / "checked.slot")
        assert not list((tmp_path / "out").iterdir())
        await store.get_to_file(ref, tmp_path / "out" / "unchecked.slot", verify=False)
        assert read_slot_file(tmp_path / "out" / "unchecked.slot").checksum_ok is False
    finally:
        await store.aclose()
        client.close()


@pytest.mark.parametrize("which", ["grow4", "rec1"])
async def test_a_restore_in_a_watched_block_reports_the_bytes_of_each_piece(
    store: ChunkedStore, slots: Slots, tmp_path: Path, which: str
) -> None:
    """A fill watching its fetch (storage.fetch_progress) is told the bytes of every piece as it
    comes in: all the plan's pieces, once each, about the file's size (what the node's fill reports
    against); a fetch outside the block
    reports to nobody."""
    src = {"grow4": slots.grow[4], "rec1": slots.recurrent[1]}[which]
    ref = SlotRef("acme", "s1", 1)
    await put(store, ref, src)
    got: list[int] = []
    with watched(got.append):
        await store.get_to_file(ref, tmp_path / "back.slot", verify=False)
    await store.get_to_file(ref, tmp_path / "again.slot", verify=False)  # (nobody watches)
    plan = json.loads((await store.inner.get_object(store._manifest(ref))).decode())["plan"]
    pieces = [size for _, _, size in objects_needed(plan)]
    assert sorted(got) == sorted(pieces) and len(got) >= 2
    assert 0.9 <= sum(got) / src.stat().st_size <= 1.1  # (the pieces' headers: a little over the file)

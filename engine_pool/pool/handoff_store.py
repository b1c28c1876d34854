"""A handoff through the store: for two nodes that cannot reach each other, though the gateway
reaches both (engine_pool.protocol.handoff).

The gateway asks the prefill engine's node for a prefill with `to_store` (a `handoff_key`): that
node prefills as for any other node (`prefill_to_file`) and uploads the exported slot file to the
object, streamed (`export`). Then it asks the decode engine's node for the handoff with
`from_store`: that node downloads the object into its decode engine's slot directory, streamed,
and installs it as any handoff (`hand_off_stored`; the slot file's checks refuse a damaged or
foreign state). The gateway made the key and deletes the object at the end, however it ends; each
node removes the files it wrote. A carried state does not go this way: such a turn runs unsplit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from pathlib import Path

from engine_pool.errors import Upstream
from storage.blobs.blobstore import BlobStore
from storage.errors import StorageError

from ..protocol.handoff import HandoffRequest, HandoffResult, Prefilled, stored_at
from .handoff import SlotCall, install, remove_files, result_of
from .supervisor import EngineSupervisor


async def export(store: BlobStore, key: str, path: Path) -> None:
    """The exported slot file at ``path`` uploaded to the handoff's object ``key``."""
    await store.put_object_file(stored_at(store.prefix, key), path)


async def hand_off_stored(
    store: BlobStore, slot_call: SlotCall, decode: EngineSupervisor, slot: int, req: HandoffRequest
) -> HandoffResult:
    """The state stored under ``req.from_store`` installed into ``decode``'s ``slot``. The prefill
    ran elsewhere: its account (slot, prompt tokens, times) is the gateway's to add; here the
    result says the bytes, the download (`export_ms`) and the install."""
    t0 = time.monotonic()
    installed = decode.spec.slot_dir / f"handoff-{uuid.uuid4().hex}.slot"
    try:
        try:
            n = await store.get_object_file(stored_at(store.prefix, req.from_store), installed)
        except StorageError as exc:  # (gone, or the store away: the handoff fails, the turn runs)
            raise Upstream(f"the handoff's state could not be read from the store: {exc}") from exc
        t_export = time.monotonic()
        restored = await install(slot_call, decode, slot, installed.name, req, None)
    finally:
        await asyncio.to_thread(remove_files, installed)
    here = Prefilled(-1, -1, n, restored.n_checkpoints, prefill_ms=0.0, export_ms=0.0)
    out = result_of(here, restored, req, req.prefill_engine, 0.0, t_export - t0, t_export, t0)
    return dataclasses.replace(out, through_store=True)

"""Slot save / restore / erase (`POST /slots/{id}?action=...`), confined to the slot directory.

A slot file name is a plain name inside `--slot-save-path`: no directories, no leading dot, only
letters, digits, `.`, `_`, `-` (`slot_file_path` is pure and says which rule a name breaks). Each
action takes a lease on its slot, so it waits (bounded by `--slot-wait-timeout`) until requests on
the slot are done and nothing starts there while the file is written or read. A restore that fails
leaves the slot empty — the caller meant to replace the session that was there.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import structlog

import native
from engine_pool.errors import BadRequest, NotFound, NotSupported, SlotChanged
from storage.background import in_background

from ..protocol.slot_actions import RestoreTimings, SaveTimings, SlotErased, SlotRestored, SlotSaved
from .runtime import Runtime

log = structlog.get_logger("engine.slots")

T = TypeVar("T")
_NAME = re.compile(r"[A-Za-z0-9._-]+")
MAX_NAME_BYTES = 255


def slot_file_path(slot_dir: Path | None, filename: Any) -> Path:
    """The file `filename` names inside `slot_dir`, or BadRequest saying which rule it breaks."""
    if slot_dir is None:
        raise NotSupported("slot save/restore is disabled: start the engine with --slot-save-path DIR")
    if not isinstance(filename, str) or not filename:
        raise BadRequest("'filename' must be a non-empty string", param="filename")
    if "/" in filename or "\\" in filename:
        raise BadRequest(
            f"'filename' must be a plain file name inside the slot directory, without directories: "
            f"{filename!r}",
            param="filename",
        )
    if filename.startswith("."):
        raise BadRequest(f"'filename' must not start with '.': {filename!r}", param="filename")
    if len(filename.encode()) > MAX_NAME_BYTES:
        raise BadRequest(f"'filename' is longer than {MAX_NAME_BYTES} bytes", param="filename")
    if not _NAME.fullmatch(filename):
        raise BadRequest(
            f"'filename' may only contain letters, digits, '.', '_' and '-': {filename!r}", param="filename"
        )
    path = (slot_dir / filename).resolve()
    if path.parent != slot_dir:  # a symlinked directory entry pointing elsewhere, say
        raise BadRequest(f"'filename' {filename!r} resolves outside the slot directory", param="filename")
    return path


async def _on_slot(
    rt: Runtime,
    slot: int,
    purpose: str,
    fn: Callable[[], T],
    expect: tuple[str, str] | None = None,
    label: tuple[str, str] | None = None,
) -> T:
    """Run `fn` in a thread under a lease on `slot`. The lease ends when `fn` does, even if the
    caller is cancelled first, so nothing else starts on the slot while the file is in use.
    `expect`: the (owner, session) label the slot must carry, else SlotChanged (409); `label`:
    the slot's label once `fn` succeeded (a restore of that session's state)."""
    await rt.leases.acquire(slot, purpose=purpose, wait_s=rt.settings.slot_wait_s)
    if expect is not None and rt.leases.label_of(slot) != expect:
        rt.leases.release(slot)
        raise SlotChanged(f"slot {slot} does not hold the session {expect[1]!r}")
    if purpose != "save":  # a restore or an erase: the slot holds nobody's named state now
        rt.leases.label(slot)

    def done(task: asyncio.Future[T]) -> None:
        if label is not None and not task.cancelled() and task.exception() is None:
            rt.leases.label(slot, *label)  # before the lease ends: no request sees it unlabelled
        rt.leases.release(slot)

    task = asyncio.ensure_future(asyncio.to_thread(fn))
    task.add_done_callback(done)
    return await asyncio.shield(task)


def _log(event: str, slot: int, filename: str, info: native.SlotFileInfo) -> None:
    """One log event for a completed save or restore."""
    log.info(
        event,
        slot=slot,
        filename=filename,
        n_tokens=info.n_tokens,
        n_bytes=info.n_bytes,
        n_checkpoints=info.n_checkpoints,
        ms=round(info.ms, 2),
    )


async def save(
    rt: Runtime, slot: int, filename: Any, expect: tuple[str, str] | None = None, durable: bool = True
) -> SlotSaved:
    """The slot's state is copied under the slot's lease (memory speed) and written to its file
    after the lease: the session's next turn starts on the slot while the file is written (a
    write-behind save of a long session writes hundreds of MB and syncs them). ``expect``: the
    (owner, session) whose state the caller means to save (the slot's label), checked under the
    lease. ``durable`` false: a handoff's file, read once on this node and deleted while a turn
    waits for it: not synced to disk, and written at the engine's priority, not in the background."""
    engine = rt.require()
    path = slot_file_path(rt.slot_dir, filename)
    snapshot = await _on_slot(rt, slot, "save", lambda: engine.snapshot_slot(slot), expect)
    write = in_background if durable else asyncio.to_thread
    info = await write(engine.write_snapshot, snapshot, str(path), durable)
    _log("slot.saved", slot, filename, info)
    return SlotSaved(slot, filename, info.n_tokens, info.n_bytes, info.n_checkpoints, SaveTimings(info.ms))


async def restore(
    rt: Runtime, slot: int, filename: Any, label: tuple[str, str] | None = None
) -> SlotRestored:
    """Load the file into the slot; ``label``: the (owner, session) whose state it is."""
    engine = rt.require()
    path = slot_file_path(rt.slot_dir, filename)
    if not path.is_file():
        raise NotFound(f"slot file {filename!r} does not exist in the slot directory", param="filename")

    def restore_or_empty() -> native.SlotFileInfo:
        try:
            return engine.restore_slot(slot, str(path))
        except native.SlotFileError:
            # Never leave the previous session in place of the one the caller asked for.
            engine.erase_slot(slot)
            raise

    try:
        info = await _on_slot(rt, slot, "restore", restore_or_empty, label=label)
    except native.SlotFileError as exc:
        log.warning("slot.restore_failed", slot=slot, filename=filename, kind=exc.kind, error=str(exc))
        raise BadRequest(
            f"cannot restore slot {slot} from {filename!r}: {exc.kind}: {exc}; the slot was left empty",
            param="filename",
            extra={"kind": exc.kind},
        ) from None
    _log("slot.restored", slot, filename, info)
    return SlotRestored(
        slot, filename, info.n_tokens, info.n_bytes, info.n_checkpoints, RestoreTimings(info.ms)
    )


async def erase(rt: Runtime, slot: int) -> SlotErased:
    engine = rt.require()
    n = await _on_slot(rt, slot, "erase", lambda: engine.erase_slot(slot))
    log.info("slot.erased", slot=slot, n_tokens=n)
    return SlotErased(slot, n)

"""A handoff with its prefill engine on another node: the state goes node to node
(engine_pool.protocol.handoff's frames), never through the store.

The decode engine's node (`hand_off_remote`) saves a carried session's state from its slot, sends
the prefill engine's node one `PREFILL` request — a frame: the `HandoffRequest` as one line of JSON
(naming the decode engine's model), then the carried slot file — with the internal credential (the
node's own HTTP client carries it), reads back a frame (`Prefilled`, then the exported slot file)
straight into its decode engine's slot directory, and installs it as a handoff on one node does
(`engine_pool.pool.handoff.install`: the slot file's checks refuse another model's state or a file
damaged on the way, and a carried session's own state is put back).

The prefill engine's node (`receive_carried`, `exported_frames`; the route is
`engine_pool.pool.routes.prefill`) writes a carried file into the prefill engine's slot directory,
runs the prefill on a lent slot as a handoff on one node does (`prefill_to_file`), and streams the
exported file back from an open handle, the file itself unlinked at once: nothing is left behind
however the answer ends.

A peer that answers an error or breaks off mid-file fails the handoff (the gateway runs the turn
unsplit); one that cannot be reached at all fails it as `PeerUnreachable`, and the gateway may go
through the store instead (engine_pool.pool.handoff_store). The caller leaving cancels the prefill
on the peer (its request's connection closes, and the peer's route cancels the prefill when its
caller is gone).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import IO

import httpx

from engine_pool.errors import ApiError, BadRequest, PayloadTooLarge, PeerUnreachable, Unavailable, Upstream
from engine_pool.http.answers import answer_json, error_object

from ..protocol.codec import WireError
from ..protocol.handoff import (
    HANDOFF_MEDIA,
    MAX_FRAME_HEAD,
    HandoffRequest,
    HandoffResult,
    Prefilled,
    prefill_path,
)
from .handoff import Carried, SlotCall, carry_out, install, remove_files, result_of
from .supervisor import EngineSupervisor

CHUNK = 1 << 20  # bytes read from, and written to, a slot file at a time
PEER_TIMEOUT = httpx.Timeout(600.0, connect=5.0)  # a prompt of a whole context, on a CPU
MAX_CARRIED_BYTES = 1 << 36  # a carried state (a whole context's KV of a large model fits)


async def hand_off_remote(
    http: httpx.AsyncClient, slot_call: SlotCall, decode: EngineSupervisor, slot: int, req: HandoffRequest
) -> HandoffResult:
    """The handoff `req` asks for, into ``decode``'s ``slot``, with the prefill engine of the node
    agent at ``req.prefill_node`` (see the module doc)."""
    t0 = time.monotonic()
    files: list[Path] = []  # whatever this handoff wrote: gone when it ends, however it ends
    carried: Carried | None = None
    try:
        if req.carry:
            carried = await carry_out(slot_call, decode, slot, req, files)
        t_carry = time.monotonic()
        installed = decode.spec.slot_dir / f"handoff-{uuid.uuid4().hex}.slot"
        files.append(installed)
        done, transfer_s = await _fetch(http, req, decode.spec.model_id, carried, installed)
        t_export = time.monotonic()
        restored = await install(slot_call, decode, slot, installed.name, req, carried)
    finally:
        await asyncio.to_thread(remove_files, *files)
    carry_s = t_carry - carried.t0 if carried is not None else 0.0
    return result_of(done, restored, req, req.prefill_engine, carry_s, transfer_s, t_export, t0)


async def _fetch(
    http: httpx.AsyncClient, req: HandoffRequest, model: str, carried: Carried | None, dest: Path
) -> tuple[Prefilled, float]:
    """The peer's prefill of ``req``: its account, and the exported file written to ``dest`` (with
    the seconds the file took to arrive)."""
    where = f"prefill engine {req.prefill_engine} on {req.prefill_node}"
    ask = dataclasses.replace(req, prefill_node="", model=model, carry_from="")  # the peer's own engine
    url = req.prefill_node.rstrip("/") + prefill_path(req.prefill_engine)
    content = _frame(ask.to_json(), carried.path if carried is not None else None)
    headers = {"content-type": HANDOFF_MEDIA}
    try:
        async with http.stream("POST", url, content=content, headers=headers, timeout=PEER_TIMEOUT) as r:
            if r.status_code != 200:
                await r.aread()
                raise _refusal(r, where)
            head, rest = await read_head(r.aiter_raw())
            done = Prefilled.from_json(json.loads(head))
            t = time.monotonic()
            n = await write_file(rest, dest, done.bytes)
            if n != done.bytes:
                raise Upstream(f"{where}: the state broke off after {n} of {done.bytes} bytes")
            return done, time.monotonic() - t
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # nothing was sent: the nodes cannot meet
        raise PeerUnreachable(f"{where}: {type(exc).__name__}: {exc}") from exc
    except httpx.HTTPError as exc:
        raise Upstream(f"{where}: {type(exc).__name__}: {exc}") from exc
    except (WireError, ValueError) as exc:  # (json's errors are ValueErrors)
        raise Upstream(f"{where} answered a frame that is not one: {exc}") from exc


def _refusal(r: httpx.Response, where: str) -> ApiError:
    """The peer's error answer as this node's: 503 stays 503 (the turn runs unsplit either way)."""
    error = error_object(answer_json(r)) or {"message": r.text[:300]}
    message = f"{where}: {error.get('message')}"
    if r.status_code == 503:
        return Unavailable(message, retry_after=1)
    if r.status_code in (400, 413, 422):  # the turn's own fault (a body the engine refuses)
        return BadRequest(message)
    return Upstream(message)


async def _frame(head: object, path: Path | None) -> AsyncIterator[bytes]:
    """A frame: ``head`` as one line of compact JSON, then the file at ``path`` (if any)."""
    yield json.dumps(head, separators=(",", ":")).encode() + b"\n"
    if path is None:
        return
    fh = await asyncio.to_thread(path.open, "rb")
    try:
        while chunk := await asyncio.to_thread(fh.read, CHUNK):
            yield chunk
    finally:
        fh.close()


async def read_head(
    chunks: AsyncIterator[bytes], limit: int = MAX_FRAME_HEAD
) -> tuple[bytes, AsyncIterator[bytes]]:
    """A frame's JSON line (at most ``limit`` bytes, else 413) and the rest of its bytes; a frame
    that ends before its line does is a 400."""
    buf = bytearray()
    async for chunk in chunks:
        buf += chunk
        end = buf.find(b"\n")
        if end >= 0:
            if end > limit:
                break
            return bytes(buf[:end]), _rest(bytes(buf[end + 1 :]), chunks)
        if len(buf) > limit:
            break
    else:
        raise BadRequest("the frame ended before its JSON line did")
    raise PayloadTooLarge(f"the frame's JSON line is longer than {limit} bytes", extra={"limit": limit})


async def _rest(first: bytes, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    if first:
        yield first
    async for chunk in chunks:
        yield chunk


async def write_file(chunks: AsyncIterator[bytes], dest: Path, limit: int) -> int:
    """``chunks`` written to ``dest`` (a new file), at most ``limit`` bytes of them (more is a 413);
    the bytes written."""
    fh = await asyncio.to_thread(dest.open, "xb")
    n, pending = 0, bytearray()
    try:
        async for chunk in chunks:
            n += len(chunk)
            if n > limit:
                raise PayloadTooLarge(f"more than the {limit} bytes announced", extra={"limit": limit})
            pending += chunk
            if len(pending) >= CHUNK:
                await asyncio.to_thread(fh.write, pending)
                pending = bytearray()
        if pending:
            await asyncio.to_thread(fh.write, pending)
    finally:
        fh.close()
    return n


# -- the prefill engine's node ---------------------------------------------------------------------
async def receive_carried(chunks: AsyncIterator[bytes], prefill: EngineSupervisor) -> Path:
    """A carried state's slot file, the rest of a `PREFILL` frame, written into the prefill
    engine's slot directory (the caller removes it)."""
    dest = prefill.spec.slot_dir / f"carry-{uuid.uuid4().hex}.slot"
    try:
        n = await write_file(chunks, dest, MAX_CARRIED_BYTES)
    except BaseException:
        await asyncio.to_thread(remove_files, dest)
        raise
    if not n:
        await asyncio.to_thread(remove_files, dest)
        raise BadRequest("'carry' is set, but no carried state follows the frame's JSON line", param="carry")
    return dest


async def nothing_more(chunks: AsyncIterator[bytes]) -> None:
    """A frame without a carried state ends after its JSON line."""
    async for chunk in chunks:
        if chunk:
            raise BadRequest("bytes follow the frame's JSON line, but 'carry' is not set", param="carry")


async def exported_frames(done: Prefilled, path: Path) -> tuple[AsyncIterator[bytes], Callable[[], None]]:
    """The answer's frame (``done``, then the exported file at ``path``) and a close for its handle.
    The file is unlinked at once: the open handle reads it, and nothing is left however the answer
    ends."""
    fh = await asyncio.to_thread(path.open, "rb")
    await asyncio.to_thread(remove_files, path)
    return _frames(done, fh), fh.close


async def _frames(done: Prefilled, fh: IO[bytes]) -> AsyncIterator[bytes]:
    try:
        yield json.dumps(done.to_json(), separators=(",", ":")).encode() + b"\n"
        while chunk := await asyncio.to_thread(fh.read, CHUNK):
            yield chunk
    finally:
        fh.close()

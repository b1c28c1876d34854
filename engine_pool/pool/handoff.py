"""A handoff on one node: a turn's prompt evaluated on a prefill engine, its state installed in a
decode engine's slot (engine_pool.protocol.handoff).

The prefill engine's slots are this node's to hand out: only handoffs run there (the gateway never
places a session on a prefill engine), so `PrefillSlots` — one owner, the event loop — lends each
slot to one handoff at a time, and a handoff waits for one at most its `wait_s` (then 503: the
gateway runs the turn unsplit). The state moves as a slot file through the node's disk, never the
store: the prefill engine saves the slot into its slot directory (the save copies the state under
the slot's lease, at memory speed, and writes the file after it), the file is hard-linked into the
decode engine's slot directory, and the decode engine restores it into the turn's slot, labelled
with the session — with the slot file's checks: another model or state format, or a damaged or
truncated file, is refused (the slot is left empty) and the gateway runs the turn unsplit.

Steps, each with its own failure: choose (`choose`, pure: the engine is a ready prefill engine of
the decode engine's model), carry (`carry` only, `carry_out`: the session's state saved from the
decode slot, linked into the prefill engine's directory, restored into the lent slot), prefill (a
chat completion with `n_predict` 0 on the lent slot, bounded by the request's `timeout_s`,
cancelled on the engine past it or when the caller leaves), export (the save, no sync to disk),
install (`install`: the restore; a carried session's own state is put back in its slot when the
install fails). `prefill_to_file` (lend, restore a carried state, prefill, export) and `install`
serve a handoff with a prefill engine on another node too (engine_pool.pool.handoff_peer), where
the files go over the network instead of being linked.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import structlog

from engine_pool.errors import ApiError, BadRequest, NotFound, Unavailable, Upstream
from engine_pool.http.answers import answer_json, error_object

from ..protocol.handoff import HandoffMode, HandoffOutcome, HandoffRequest, HandoffResult, Prefilled, Role
from ..protocol.slot_actions import SlotRestored, SlotSaved
from .supervisor import EngineSupervisor, State

log = structlog.get_logger("engine.node")

PREFILL_TIMEOUT = httpx.Timeout(600.0, connect=5.0)  # a prompt of a whole context, on a CPU
# The gateway's fields that name the decode engine's slots, or its session there: meaningless on the
# prefill engine (its slots are lent per handoff), so they are dropped from the prefill's body.
_DECODE_ONLY = (
    "id_slot",
    "prefix_slots",
    "slot_expect",
    "slot_session",
    "max_tokens_default",
    "stream_options",
)

# The agent's one slot action (`NodeAgent._slot_call`): engine, slot, the answer it expects, file, and
# the body's other fields (a label, `durable`).
SlotCall = Callable[[EngineSupervisor, int, type[Any], str | None, Mapping[str, Any] | None], Awaitable[Any]]
# A handoff's files are read once, on this node, and deleted: written without a sync to disk (a
# crash ends the handoff anyway; the checksums still catch a damaged file).
TRANSIENT: Mapping[str, Any] = {"durable": False}


def choose(
    prefill: EngineSupervisor | None, engine_id: str, model: str, roles: dict[str, str]
) -> EngineSupervisor:
    """The prefill engine a handoff may use, or why not: 404 (not on this node), 400 (not a prefill
    engine, or not of ``model``: '' when unknown), 503 (not ready)."""
    if prefill is None:
        raise NotFound(f"engine {engine_id!r} is not on this node", param="prefill_engine")
    if roles.get(engine_id) != Role.PREFILL:
        raise BadRequest(f"engine {engine_id!r} is not a prefill engine", param="prefill_engine")
    if model and prefill.spec.model_id != model:
        raise BadRequest(
            f"engine {engine_id!r} serves {prefill.spec.model_id!r}, not {model!r}", param="prefill_engine"
        )
    if prefill.state is not State.READY:
        raise Unavailable(f"prefill engine {engine_id} is {prefill.state}", retry_after=1)
    return prefill


def one_source(req: HandoffRequest) -> None:
    """A handoff asked of the decode engine's node takes its state from one place: a prefill
    engine (of this node, or of ``prefill_node``), or the store (``from_store``, never carried);
    ``to_store`` belongs to the prefill engine's node's request. 400 otherwise."""
    if req.to_store:
        raise BadRequest("'to_store' belongs to a prefill request, not a handoff", param="to_store")
    if req.from_store and (req.carry or req.prefill_node):
        raise BadRequest("a state from the store is not carried, nor fetched from a node", param="from_store")


def prefill_body(body: dict[str, Any], tenant: str, slot: int, mode: str) -> dict[str, Any]:
    """The chat body the prefill engine runs: the turn's (so the same template, tools and checkpoint
    hints give the same tokens), on the lent slot, labelled with the tenant (a slot another tenant
    used last is cleared first), nothing generated; `last-token` holds the prompt's last token back."""
    out = {k: v for k, v in body.items() if k not in _DECODE_ONLY}
    out.update(id_slot=slot, n_predict=0, n=1, stream=False, slot_owner=tenant)
    for alias in ("max_tokens", "max_completion_tokens"):
        out.pop(alias, None)
    if mode == HandoffMode.LAST_TOKEN:
        out["prefill_hold_back"] = 1
    return out


def outcome_of(exc: BaseException) -> HandoffOutcome:
    """How a failed handoff counts (`handoffs_total{result}`)."""
    if isinstance(exc, asyncio.CancelledError):
        return HandoffOutcome.CANCELLED  # its caller left (the gateway's client did)
    if isinstance(exc, ApiError) and exc.extra.get("kind") is not None:
        return HandoffOutcome.REFUSED  # the decode engine's slot-file checks said no
    if isinstance(exc, Unavailable):
        return HandoffOutcome.UNAVAILABLE
    return HandoffOutcome.FAILED


class PrefillSlots:
    """The slots of this node's prefill engines, each lent to one handoff at a time (see the module
    doc). Owned by the event loop; no lock beyond the queues."""

    def __init__(self, engines: dict[str, int]) -> None:
        self._free: dict[str, asyncio.Queue[int]] = {}
        for engine_id, n_slots in engines.items():
            q: asyncio.Queue[int] = asyncio.Queue()
            for n in range(n_slots):
                q.put_nowait(n)
            self._free[engine_id] = q

    async def lend(self, engine_id: str, wait_s: float) -> int:
        try:
            async with asyncio.timeout(wait_s):
                return await self._free[engine_id].get()
        except TimeoutError:
            raise Unavailable(
                f"prefill engine {engine_id} has had no free slot for {wait_s:g} s", retry_after=1
            ) from None

    def give_back(self, engine_id: str, slot: int) -> None:
        self._free[engine_id].put_nowait(slot)


async def hand_off(
    http: httpx.AsyncClient,
    slots: PrefillSlots,
    slot_call: SlotCall,
    decode: EngineSupervisor,
    slot: int,
    prefill: EngineSupervisor,
    req: HandoffRequest,
) -> HandoffResult:
    """The handoff `req` asks for, into ``decode``'s ``slot``, with a prefill engine of this node (see
    the module doc)."""
    t0 = time.monotonic()
    files: list[Path] = []  # whatever this handoff wrote: gone when it ends, however it ends
    carried: Carried | None = None
    try:
        carried_here: str | None = None
        if req.carry:
            carried = await carry_out(slot_call, decode, slot, req, files)
            dest = prefill.spec.slot_dir / carried.name
            files.append(dest)
            await asyncio.to_thread(link_or_copy, carried.path, dest)
            carried_here = carried.name
        t_carry = time.monotonic()
        name = f"handoff-{uuid.uuid4().hex}.slot"
        exported, installed = prefill.spec.slot_dir / name, decode.spec.slot_dir / name
        files += [exported, installed]
        done = await prefill_to_file(http, slots, slot_call, prefill, req, carried_here, name)
        t_moved = time.monotonic()
        await asyncio.to_thread(link_or_copy, exported, installed)
        t_export = time.monotonic()
        restored = await install(slot_call, decode, slot, name, req, carried)
    finally:
        await asyncio.to_thread(remove_files, *files)
    carry_s = t_carry - carried.t0 if carried is not None else 0.0
    return result_of(done, restored, req, prefill.spec.engine_id, carry_s, t_export - t_moved, t_export, t0)


def result_of(
    done: Prefilled,
    restored: SlotRestored,
    req: HandoffRequest,
    prefill_engine: str,
    carry_s: float,
    transfer_s: float,
    t_export: float,
    t0: float,
) -> HandoffResult:
    """A handoff's result from the prefill side's account (``done``) and the decode side's times:
    ``carry_s`` a carried state's save and way to the prefill side, ``transfer_s`` the exported
    file's way to the decode engine's directory (a link, or the network), reached at ``t_export``;
    the install ends now; ``t0`` the handoff's start."""
    t3 = time.monotonic()
    return HandoffResult(
        prefill_engine,
        done.prefill_slot,
        restored.n_restored,
        done.prompt_n,
        done.bytes,
        restored.n_checkpoints,
        req.mode,
        prefill_ms=done.prefill_ms,
        export_ms=round(done.export_ms + transfer_s * 1000, 2),
        install_ms=round((t3 - t_export) * 1000, 2),
        ms=round((t3 - t0) * 1000, 2),
        carried_bytes=done.carried_bytes,
        carry_ms=round(carry_s * 1000 + done.carry_ms, 2) if req.carry else 0.0,
        prefill_node=req.prefill_node,
    )


async def prefill_to_file(
    http: httpx.AsyncClient,
    slots: PrefillSlots,
    slot_call: SlotCall,
    prefill: EngineSupervisor,
    req: HandoffRequest,
    carried: str | None,
    name: str,
) -> Prefilled:
    """``req``'s prompt evaluated on a lent slot of ``prefill`` and exported as ``name`` in its slot
    directory (the caller removes it). ``carried``: a slot file there to restore into the lent slot
    first (a session's state: only the prompt's new tail is evaluated)."""
    lent = await slots.lend(prefill.spec.engine_id, req.wait_s)
    try:
        carried_bytes, t0 = 0, time.monotonic()
        if carried is not None:  # (no label: the prefill's body, labelled with the tenant, starts from it)
            carried_bytes = (await slot_call(prefill, lent, SlotRestored, carried, None)).n_read
        t1 = time.monotonic()
        body = prefill_body(req.body, req.tenant, lent, req.mode)
        answer = await _prefill(http, prefill, body, req.timeout_s)
        t2 = time.monotonic()
        saved: SlotSaved = await slot_call(prefill, lent, SlotSaved, name, TRANSIENT)
    finally:
        slots.give_back(prefill.spec.engine_id, lent)
    timings = answer.get("timings")
    prompt_n = timings.get("prompt_n", -1) if isinstance(timings, dict) else -1
    return Prefilled(
        lent,
        int(prompt_n) if isinstance(prompt_n, int | float) else -1,
        saved.n_written,
        saved.n_checkpoints,
        prefill_ms=round((t2 - t1) * 1000, 2),
        export_ms=round((time.monotonic() - t2) * 1000, 2),
        carried_bytes=carried_bytes,
        carry_ms=round((t1 - t0) * 1000, 2),
    )


async def install(
    slot_call: SlotCall,
    decode: EngineSupervisor,
    slot: int,
    name: str,
    req: HandoffRequest,
    carried: Carried | None,
) -> SlotRestored:
    """The handed state (``name`` in the decode engine's slot directory) restored into the turn's
    slot, labelled with the session; should that fail, a carried session's own state is put back in
    its slot (the turn then runs there, unsplit)."""
    label = {"slot_owner": req.tenant, "slot_session": req.session}
    try:
        restored: SlotRestored = await slot_call(decode, slot, SlotRestored, name, label)
    except BaseException:
        if carried is not None:
            with suppress(ApiError):
                await slot_call(decode, slot, SlotRestored, carried.name, label)
        raise
    return restored


@dataclass(frozen=True)
class Carried:
    """A session's state saved from its decode slot for a carried handoff: kept in the decode
    engine's slot directory until the handoff ends, to put it back should the install fail."""

    path: Path
    t0: float

    @property
    def name(self) -> str:
        return self.path.name


async def carry_out(
    slot_call: SlotCall, decode: EngineSupervisor, slot: int, req: HandoffRequest, files: list[Path]
) -> Carried:
    """The session's state saved from its decode slot (only while the slot still holds the session,
    or the parent it was forked from, `carry_from`: else 409, and the turn runs unsplit); the slot
    keeps its state meanwhile."""
    t0 = time.monotonic()
    path = decode.spec.slot_dir / f"carry-{uuid.uuid4().hex}.slot"
    files.append(path)
    expect = {"slot_owner": req.tenant, "slot_expect": req.carry_from or req.session, **TRANSIENT}
    await slot_call(decode, slot, SlotSaved, path.name, expect)
    return Carried(path, t0)


async def _prefill(
    http: httpx.AsyncClient, prefill: EngineSupervisor, body: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    """The prompt evaluated on the prefill engine within ``timeout_s``; its answer (with its
    timings). Past the bound, or when the caller is cancelled (the gateway's client left), the
    request is abandoned: its connection closes, and the engine cancels a request whose client is
    gone."""
    engine_id = prefill.spec.engine_id
    try:
        async with asyncio.timeout(timeout_s):
            r = await http.post(f"{prefill.url}/v1/chat/completions", json=body, timeout=PREFILL_TIMEOUT)
    except TimeoutError:
        raise Unavailable(
            f"prefill engine {engine_id} took longer than {timeout_s:g} s; the prefill was cancelled",
            retry_after=1,
        ) from None
    except httpx.HTTPError as exc:
        raise Upstream(f"prefill engine {engine_id}: {type(exc).__name__}: {exc}") from exc
    answer = answer_json(r)
    if r.status_code == 200 and isinstance(answer, dict):
        return answer
    error = error_object(answer) or {"message": r.text[:300]}
    if r.status_code == 503:
        raise Unavailable(f"prefill engine {engine_id}: {error.get('message')}", retry_after=1)
    if r.status_code < 500:  # the turn's own fault (a body the engine refuses): the decode side says so
        raise BadRequest(f"prefill engine {engine_id}: {error.get('message')}")
    raise Upstream(f"prefill engine {engine_id}: {error.get('message')}")


def link_or_copy(src: Path, dest: Path) -> None:
    """A file into an engine's slot directory (an exported state, a fill's copy from the spill
    cache): a hard link (one file system: no copy), else a copy."""
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)


def remove_files(*paths: Path) -> None:
    """Each of ``paths`` gone, whether it was there or not (a handoff's files, however it ended)."""
    for path in paths:
        with suppress(OSError):
            path.unlink()

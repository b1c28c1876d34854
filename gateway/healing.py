"""Index healing: a lost or flushed index is noticed and rebuilt while turns go on.

A redis-server restarted empty (the chart's default keeps nothing on disk) or a ``FLUSHALL`` takes
every session record away, although the sessions' states are still in the engines' slots, the
nodes' spill caches and the store. Without healing each of them would be served as new: a full
re-prefill, and saves whose generation numbers the store already holds.

How it heals (storage.index.epoch has the keys):

1. **Noticed.** Every turn's opening read returns the index's epoch and its built epoch
   (`saw`); a watcher reads them every ``interval_s`` too, so an idle gateway heals before the
   next turn comes. A missing epoch, or one this process did not know, starts step 2.
2. **Rebuilt, once.** The process claims a new epoch (the first claim wins; everyone adopts it)
   and takes the rebuilding lease; the one that holds it rebuilds the index from the store's
   manifests (storage.index.reindex), then from the nodes' spill caches (a generation saved while
   the store was away is only there until the flush: gateway.cluster's `unstored_copies`), then
   from the engines' slots: each slot says whose session it holds (the label every turn gives
   it), and a session no copy of which is newer is recorded live there (`labelled_slots`) — an
   `on-evict` tenant's sessions were never stored. Then it records the epoch as built; the others
   wait for that.
3. **Meanwhile**, a turn whose session has no record waits a few seconds for this process's
   rebuild, then looks the session up in the store and the spill caches before it treats it as
   new (`recover`): it restores, or goes on in its slot, instead of re-prefilling.

A record can also fall behind without a loss: a save finished but Redis was away when it would
have recorded the generation (a partition), and the engine died before the next save. The record
then names an older generation (or none) than one its save was handed (`reserved`); `catch_up`
looks for that copy before the turn is placed (`behind`).

One owner: the healing task and the state it learns live here, changed only on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import structlog

from engine_pool.process import loop as event_loop
from engine_pool.protocol.node import UnstoredCopy
from gateway.cluster import LabelledSlot
from gateway.metrics import Metrics
from storage.blobs.blobstore import BlobStore
from storage.errors import StorageError
from storage.index.epoch import IndexEpoch, IndexState, Lease, index_state
from storage.index.records import SessionRecord, SessionState
from storage.index.reindex import adopt_stored, reindex, reindex_session
from storage.index.session_index import SessionIndex

log = structlog.get_logger("slotkeeper.gateway")


class IndexHealing:
    """Watches the index's epoch and heals a lost index (see the module doc)."""

    def __init__(
        self,
        epoch: IndexEpoch,
        store: BlobStore,
        index: SessionIndex,
        metrics: Metrics,
        *,
        slots: Callable[[], Awaitable[list[LabelledSlot]]] | None = None,
        unstored: Callable[[str | None, str | None], Awaitable[list[UnstoredCopy]]] | None = None,
        interval_s: float = 2.0,
        lease_ttl_s: float = 600.0,
        wait_s: float = 10.0,
    ) -> None:
        """``slots``: the engines' labelled slots, ``unstored``: the generations only the nodes'
        spill caches hold, every session's or (tenant, session)'s (both gateway.cluster);
        ``lease_ttl_s``: how long a rebuilding process that died holds the others back; ``wait_s``:
        how long a turn without a record waits for the rebuild before it looks in the store itself."""
        self._epoch = epoch
        self._store, self._index, self._metrics = store, index, metrics
        self._slots, self._unstored = slots, unstored
        self._wait_s = wait_s
        self._interval_s = interval_s
        self._lease_ttl_s = lease_ttl_s
        self.known: str | None = None  # the epoch this process holds the index to be in
        self.healing = False  # records may be missing: look sessions up before calling them new
        self._task: asyncio.Task[None] | None = None
        self._histories: set[str] = set()  # the primaries' replication histories seen so far
        self._last = ""  # the epoch as the previous watch found it

    async def start(self, *, wait: bool) -> None:
        """Claim the epoch at start-up. A fresh epoch (an empty Redis, or a first start) means the
        index must be built from the store: before the process serves with ``wait`` (the in-process
        index: nothing else fills it), else in the background like any loss."""
        epoch, created = await self._epoch.claim()
        self.known = epoch
        # The primaries as they are now: a failover from here on shows a history not seen (_look).
        self._histories, self._last = set(await self._epoch.histories()), epoch
        if created and wait:
            await self._heal()
        else:
            self.saw(*await self._epoch.read())

    async def recover(self, tenant: str, session: str) -> SessionRecord | None:
        """While the index heals: the record of a session the index lacks, once this process's rebuild
        is over (it may find the session live in its slot), else from its newest stored generation;
        else from a node's spill cache; None when none knows it (a new session) or none can say."""
        if not self.healing:
            return None
        try:
            record = await self._rebuilt(tenant, session)
            if record is None and await self._look_up(tenant, session):
                record = await self._index.find(tenant, session)
            if record is None:
                return None
        except StorageError as exc:  # Redis away again: the turn goes on as a new session's
            log.warning("index.recover_failed", tenant=tenant, session=session, error=str(exc))
            return None
        self._metrics.index_recovered.inc()
        return record

    async def catch_up(self, record: SessionRecord) -> SessionRecord:
        """The record of a session placed anew, caught up with a copy newer than it names (see
        the module doc): the record as it is when it is not `behind`, or nothing newer is found,
        or nothing can say."""
        if not behind(record):
            return record
        tenant, session = record.tenant, record.session
        try:
            if not await self._look_up(tenant, session):
                return record
            found = await self._index.find(tenant, session)
        except StorageError as exc:
            log.warning("index.catch_up_failed", tenant=tenant, session=session, error=str(exc))
            return record
        if found is None:
            return record
        log.warning(
            "index.caught_up", tenant=tenant, session=session, was=record.generation, now=found.generation
        )
        self._metrics.index_recovered.inc()
        return found

    async def _look_up(self, tenant: str, session: str) -> bool:
        """The session's newest stored generation and its newest in a node's spill cache (a save
        made while the store was away), each recorded unless the index knows a newer state; True
        when the index learned something. A store that is away is passed over."""
        learned = False
        try:
            learned = await reindex_session(self._store, self._index, tenant, session)
        except StorageError as exc:
            log.info("index.look_up_store_failed", tenant=tenant, session=session, error=str(exc))
        return await self._adopt_unstored(tenant, session) > 0 or learned

    async def _adopt_unstored(self, tenant: str | None = None, session: str | None = None) -> int:
        """Record the generations only the nodes' spill caches hold (every session's, or one's),
        newest per session, unless the index knows newer; how many it learned."""
        if self._unstored is None:
            return 0
        newest: dict[tuple[str, str], UnstoredCopy] = {}
        for c in await self._unstored(tenant, session):
            had = newest.get((c.tenant, c.session))
            if had is None or had.generation < c.generation:
                newest[(c.tenant, c.session)] = c
        learned = 0
        for c in newest.values():
            learned += await adopt_stored(self._index, unstored_record(c))
        return learned

    def saw(self, epoch: str, built: str) -> None:
        """The epoch and built epoch as a read found them: a lost, changed or unbuilt index starts
        the healing task unless it runs already."""
        state = index_state(self.known, epoch, built)
        if state is IndexState.READY:
            return
        self.healing = True
        if self._task is None or self._task.done():
            log.warning(
                "index.lost" if state is not IndexState.HEALING else "index.healing", state=state.value
            )
            self._task = asyncio.create_task(self._heal(), name="index-healing")

    async def watch(self) -> None:
        """:meth:`_look` every ``interval_s`` (a loop to run as a task; a Redis away is retried)."""
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self._look()
            except StorageError as exc:
                log.debug("index.watch_failed", error=str(exc))

    async def _look(self) -> None:
        """Read the epoch and the primaries' replication histories: a history never seen before (a
        replica promoted, which may have lost the last writes) under the epoch the previous look
        found renews the epoch, so that every gateway heals (storage.index.epoch). Under another
        epoch (or none) the index was lost outright (a server restarted empty shows a new history
        too), which :meth:`saw` heals by itself."""
        histories = await self._epoch.histories()
        epoch, built = await self._epoch.read()
        if self._histories and histories - self._histories and epoch and epoch == self._last:
            log.warning("index.failover", histories=sorted(histories - self._histories))
            epoch = await self._epoch.renew(epoch)
        self._histories |= histories
        self._last = epoch
        self.saw(epoch, built)

    async def _rebuilt(self, tenant: str, session: str) -> SessionRecord | None:
        """The session's record once this process's rebuild is over (at most ``wait_s``)."""
        task = self._task
        if task is not None and not task.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), self._wait_s)
        return await self._index.find(tenant, session)

    async def _adopt_live(self) -> int:
        """Record the sessions the engines' slots hold (most tokens first: a session named by two
        slots is the fuller one's) in slots nobody in the index occupies; how many were adopted."""
        if self._slots is None:
            return 0
        labelled = sorted(await self._slots(), key=lambda s: -s.tokens)
        taken: set[tuple[str, int]] = set()  # slots the index already places a session in
        for engine in {s.engine for s in labelled}:
            for tenant, session in await self._index.engine_sessions(engine):
                record = await self._index.find(tenant, session)
                if record is not None and record.place is not None:
                    taken.add(record.place)
        adopted = 0
        for s in labelled:
            if (s.engine, s.slot) in taken:
                continue
            if await self._index.adopt_live(
                s.tenant, s.session, engine=s.engine, slot=s.slot, tokens=s.tokens, model=s.model
            ):
                adopted += 1
                taken.add((s.engine, s.slot))
        self._metrics.index_live_adopted.inc(adopted)
        return adopted

    async def close(self) -> None:
        if self._task is not None:
            await event_loop.cancel_and_wait(self._task)

    async def _heal(self) -> None:
        """Steps 2 and 3 of the module doc, until the epoch this process knows is built. A Redis away
        ends the attempt (the next read that finds it back starts another)."""
        self.healing = True
        try:
            while True:
                epoch, _ = await self._epoch.claim()
                self.known = epoch
                current, built = await self._epoch.read()
                if current == epoch and built == epoch:
                    break
                answer, lease = await self._epoch.take_lease(epoch, self._lease_ttl_s)
                if answer is Lease.HELD:  # another process rebuilds: wait for it (or its lease to lapse)
                    await asyncio.sleep(min(self._interval_s, 0.5))
                if answer is not Lease.TAKEN:
                    continue
                log.info("index.rebuilding", epoch=epoch)
                try:
                    report = await reindex(self._store, self._index)
                    unstored = await self._adopt_unstored()
                    live = await self._adopt_live()
                except BaseException:
                    await self._epoch.give_lease(lease)
                    raise
                if await self._epoch.mark_built(epoch, lease):
                    log.info(
                        "index.rebuilt",
                        epoch=epoch,
                        sessions=report.sessions,
                        restored=report.restored,
                        skipped=len(report.skipped),
                        unstored=unstored,
                        live=live,
                    )
                    self._metrics.index_rebuilds.inc()
                    break
            self.healing = False
        except StorageError as exc:
            log.warning("index.heal_failed", error=str(exc))


def behind(record: SessionRecord) -> bool:
    """Whether a save was handed a generation the record never learned the end of (a copy newer
    than the record names may exist), while the session is not live in a slot (a slot is newer
    than any copy). Pure."""
    return not record.live and record.reserved > max(record.generation, record.floor)


def unstored_record(copy: UnstoredCopy) -> SessionRecord:
    """The record of a session spilled at a generation only a node's spill cache holds. Pure."""
    return SessionRecord(
        copy.tenant,
        copy.session,
        SessionState.SPILLED,
        model=copy.model,
        tokens=copy.tokens,
        generation=copy.generation,
        blob_key=copy.key,
        bytes=copy.bytes,
        last_used=copy.saved_at,
    )

"""The chunk ledger on Redis: save leases against the collector, collection epochs, stored bytes.

Content-addressed pieces are shared, so a save that finds a piece already stored must not see it
collected before its manifest names it. Per tenant:

* a save holds a **lease** (``ZSET`` of saver ids scored by expiry, ms) from before its first
  existence check until its manifest is written; it is taken only while no collector holds or waits
  for the tenant (the collector's key is WATCHed, so a collector arriving meanwhile makes it retry);
* the **collector** first claims the tenant (``SET NX PX``), which stops new leases, then waits for
  the live leases to end (an expired lease — a saver that died — no longer counts), collects, bumps
  the tenant's **epoch** and releases. A saver whose lease expired before its manifest was written
  refuses to write it (:meth:`SaveLease.check`), so a collector never runs beside a committing save;
* the epoch tells a store's cache of "pieces known to be there" when to forget them;
* **reference counts** per piece: a save adds one for each piece its manifest names before writing
  it, deleting a manifest takes them back after; a count is thus never below the number of
  manifests naming the piece (a crash between the steps leaks, it never loses). Pieces whose count
  reaches 0 are remembered, and :meth:`ChunkedStore.collect_unnamed` deletes them under the
  collector's claim after checking the count again — a turn's garbage goes without listing the
  tenant. A full collection rebuilds the counts from the manifests and marks them exact; without
  that mark (Redis lost its data) counts are not trusted and only full collections delete;
* the tenant's **stored bytes** (the quota's counter, ``Keyspace.stored_bytes``) is what the store
  holds for it: saves add the bytes they wrote, deletes subtract, each collection sets it exactly.

Transactions are WATCH/MULTI (:func:`storage.index.keyspace.transact`), so it runs on the in-process Redis
too. Times are the caller's clock (leases are minutes long; clock skew of seconds is harmless).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import structlog

from storage.errors import LockBusy, LockLost, StoreUnavailable
from storage.index.keyspace import Keyspace, redis_errors, text, text_map, transact

log = structlog.get_logger("slotkeeper.storage")


@dataclass(frozen=True)
class LedgerKeys:
    keys: Keyspace

    def savers(self, tenant: str) -> str:
        return f"{self.keys.tenant(tenant)}:chunks:savers"

    def collector(self, tenant: str) -> str:
        return f"{self.keys.tenant(tenant)}:chunks:collector"

    def epoch(self, tenant: str) -> str:
        return f"{self.keys.tenant(tenant)}:chunks:epoch"

    def refs(self, tenant: str) -> str:
        """HASH piece -> how many committed manifests name it (never below the truth)."""
        return f"{self.keys.tenant(tenant)}:chunks:refs"

    def unnamed(self, tenant: str) -> str:
        """HASH piece -> bytes: pieces whose count reached 0 (candidates for the next collection)."""
        return f"{self.keys.tenant(tenant)}:chunks:unnamed"

    def manifests(self, tenant: str) -> str:
        """SET of the manifests whose pieces ``refs`` counts (a manifest is counted at most once)."""
        return f"{self.keys.tenant(tenant)}:chunks:manifests"

    def writing(self, tenant: str) -> str:
        """Prefix of the per-generation write claims (``SET NX PX``): one writer per generation."""
        return f"{self.keys.tenant(tenant)}:chunks:writing:"

    def refs_ok(self, tenant: str) -> str:
        """Set by a full collection once ``refs`` is exact; absent (Redis lost it): counts unusable."""
        return f"{self.keys.tenant(tenant)}:chunks:refs_ok"


@dataclass
class SaveLease:
    """A save's lease on one tenant's pieces; ``epoch`` is the collection epoch it started in."""

    ledger: ChunkLedger
    tenant: str
    saver: str
    epoch: int
    expires_ms: int

    async def check(self, margin_s: float | None = None) -> None:
        """Raise :class:`LockLost` unless the lease holds for ``margin_s`` more (before a commit;
        default: a quarter of the lease, at most 30 s)."""
        margin = min(30.0, self.ledger.lease_s / 4) if margin_s is None else margin_s
        await self.ledger._check(self, margin)


class ChunkLedger:
    def __init__(
        self,
        redis: Any,
        *,
        prefix: str = "slotkeeper",
        lease_s: float = 600.0,
        collect_s: float = 600.0,
        wait_s: float = 15.0,
        drain_s: float = 10.0,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        """``wait_s``: how long a save waits for a collector before it gives way (:class:`LockBusy`:
        the node keeps the file and uploads it later); ``drain_s``: how long a collector holds new
        saves back waiting for those running to end before it gives way itself (a saver that died
        with its lease unreleased must not hold a tenant's saves back for the lease's length)."""
        self._redis, self._k = redis, LedgerKeys(Keyspace(prefix))
        self.keys = self._k.keys
        self.lease_s, self.collect_s, self.wait_s, self.drain_s = lease_s, collect_s, wait_s, drain_s
        self._clock, self._sleep = clock, sleep
        self._releasing: set[asyncio.Task[None]] = set()  # leases whose end Redis missed

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    # -- saves ------------------------------------------------------------------------------------
    @asynccontextmanager
    async def saving(self, tenant: str) -> AsyncIterator[SaveLease]:
        """Hold a save lease for the block; waits (up to ``wait_s``) while a collector runs."""
        lease = await self._begin_save(tenant)
        try:
            yield lease
        finally:
            await self._or_later(
                lambda: self._end_save(lease), lease.expires_ms, "chunks.lease_ended_late", tenant
            )

    async def _end_save(self, lease: SaveLease) -> None:
        async with redis_errors():
            await self._redis.zrem(self._k.savers(lease.tenant), lease.saver)

    async def _or_later(
        self, step: Callable[[], Awaitable[None]], until_ms: int, event: str, tenant: str
    ) -> None:
        """``step()`` (ending a save's lease, or a collector's claim); when Redis is away, raise, and
        take the step once it answers again (until ``until_ms``, when the key lapses by itself):
        left in place, it would hold the tenant's collectors — or saves — back for its whole TTL."""
        try:
            await step()
        except StoreUnavailable:
            task = asyncio.create_task(self._later(step, until_ms, event, tenant), name=f"{event}:{tenant}")
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)
            raise

    async def _later(
        self,
        step: Callable[[], Awaitable[None]],
        until_ms: int,
        event: str,
        tenant: str,
        every_s: float = 0.5,
    ) -> None:
        while self._now_ms() < until_ms:
            await self._sleep(every_s)  # a retry's pace: Redis gives no signal when it is back
            try:
                await step()
            except StoreUnavailable:
                continue
            log.info(event, tenant=tenant)
            return

    async def _begin_save(self, tenant: str) -> SaveLease:
        saver, savers, collector = uuid.uuid4().hex, self._k.savers(tenant), self._k.collector(tenant)
        deadline, delay = self._clock() + self.wait_s, 0.005
        while True:

            async def body(pipe: Any) -> SaveLease | None:
                if await pipe.pttl(collector) != -2:  # held (not EXISTS: see engines.heartbeat)
                    return None
                epoch = int(await pipe.get(self._k.epoch(tenant)) or 0)
                expires = self._now_ms() + int(self.lease_s * 1000)
                pipe.multi()
                pipe.zadd(savers, {saver: expires})
                pipe.pexpire(savers, int(self.lease_s * 2000))
                return SaveLease(self, tenant, saver, epoch, expires)

            lease = await transact(self._redis, [collector], body)
            if lease is not None:
                return lease
            if self._clock() > deadline:
                raise LockBusy(f"tenant {tenant}: the chunk collector held saves for {self.wait_s:.0f} s")
            await self._sleep(delay)
            delay = min(delay * 2, 0.5)

    async def _check(self, lease: SaveLease, margin_s: float) -> None:
        async with redis_errors():
            score = await self._redis.zscore(self._k.savers(lease.tenant), lease.saver)
        if score is None or score < self._now_ms() + margin_s * 1000:
            raise LockLost(f"tenant {lease.tenant}: the save lease lapsed before its manifest was written")

    # -- the collector ------------------------------------------------------------------------------
    @asynccontextmanager
    async def collecting(self, tenant: str) -> AsyncIterator[CollectorClaim]:
        """Hold the tenant's pieces against every save for the block; :class:`LockBusy` when another
        collector holds them or the saves did not end within ``wait_s``."""
        claim = await self._claim(tenant)
        try:
            yield claim
        finally:
            await self._release_or_later(claim)

    async def _release_or_later(self, claim: CollectorClaim, bump: bool = True) -> None:
        until = self._now_ms() + int(self.collect_s * 1000)  # (at the latest: renewals move it on)
        await self._or_later(
            lambda: self._release(claim, bump), until, "chunks.collector_released_late", claim.tenant
        )

    async def _claim(self, tenant: str) -> CollectorClaim:
        token, key = uuid.uuid4().hex, self._k.collector(tenant)
        async with redis_errors():
            if not await self._redis.set(key, token, nx=True, px=int(self.collect_s * 1000)):
                raise LockBusy(f"tenant {tenant}: another collector is running")
        claim = CollectorClaim(self, tenant, token)
        deadline, delay = self._clock() + self.drain_s, 0.005
        try:
            while True:
                async with redis_errors():
                    savers = self._k.savers(tenant)
                    await self._redis.zremrangebyscore(savers, "-inf", self._now_ms())
                    if not await self._redis.zcard(savers):
                        return claim
                if self._clock() > deadline:
                    raise LockBusy(f"tenant {tenant}: saves still running after {self.drain_s:.0f} s")
                await self._sleep(delay)
                delay = min(delay * 2, 0.5)
        except BaseException:
            await self._release_or_later(claim, bump=False)
            raise

    async def _release(self, claim: CollectorClaim, bump: bool = True) -> None:
        key = self._k.collector(claim.tenant)

        async def body(pipe: Any) -> None:
            mine = text(await pipe.get(key) or "") == claim.token
            pipe.multi()
            if bump:
                pipe.incr(self._k.epoch(claim.tenant))
            if mine:
                pipe.delete(key)

        await transact(self._redis, [key], body)

    async def _hold(self, claim: CollectorClaim) -> None:
        key = self._k.collector(claim.tenant)

        async def body(pipe: Any) -> bool:
            mine = text(await pipe.get(key) or "") == claim.token
            pipe.multi()
            if mine:
                pipe.pexpire(key, int(self.collect_s * 1000))
            return mine

        if not await transact(self._redis, [key], body):
            raise LockLost(f"tenant {claim.tenant}: the collector's claim lapsed")

    # -- reference counts ---------------------------------------------------------------------------
    async def claim_write(self, tenant: str, manifest: str) -> str | None:
        """One writer per generation: a token while this caller writes ``manifest``, else None."""
        token = uuid.uuid4().hex
        async with redis_errors():
            # as long as the save may still commit: its wait for a collector, then its lease
            ttl_ms = int((self.wait_s + self.lease_s) * 1000)
            ok = await self._redis.set(self._k.writing(tenant) + manifest, token, nx=True, px=ttl_ms)
        return token if ok else None

    async def release_write(self, tenant: str, manifest: str, token: str) -> None:
        key = self._k.writing(tenant) + manifest

        async def body(pipe: Any) -> None:
            mine = text(await pipe.get(key) or "") == token
            pipe.multi()
            if mine:
                pipe.delete(key)

        await transact(self._redis, [key], body)

    async def name(self, tenant: str, manifest: str, pieces: Mapping[str, int]) -> None:
        """``manifest``, naming ``pieces`` (piece -> bytes), is about to be written: count them once."""
        listed = self._k.manifests(tenant)

        async def body(pipe: Any) -> None:
            counted = await pipe.sismember(listed, manifest)
            pipe.multi()
            if not counted:
                pipe.sadd(listed, manifest)
                for piece in pieces:
                    pipe.hincrby(self._k.refs(tenant), piece, 1)

        await transact(self._redis, [listed], body)

    async def unname(self, tenant: str, manifest: str, pieces: Mapping[str, int]) -> None:
        """``manifest`` was deleted: take its counts back once (a second delete of it, or one after a
        collection rebuilt the counts without it, changes nothing); pieces no manifest names any
        more become candidates."""
        listed = self._k.manifests(tenant)

        async def body(pipe: Any) -> bool:
            counted = await pipe.sismember(listed, manifest)
            pipe.multi()
            if counted:
                pipe.srem(listed, manifest)
                for piece in pieces:
                    pipe.hincrby(self._k.refs(tenant), piece, -1)
            return bool(counted)

        if not await transact(self._redis, [listed], body) or not pieces:
            return
        async with redis_errors():
            counts = await self._redis.hmget(self._k.refs(tenant), list(pieces))
            rows = zip(pieces.items(), counts, strict=True)
            zero = {p: n for (p, n), c in rows if c is None or int(c) <= 0}
            if zero:
                await self._redis.hset(self._k.unnamed(tenant), mapping=zero)

    async def unnamed(self, tenant: str) -> dict[str, int]:
        """Candidates whose count is still 0 now, piece -> bytes (empty when counts are not exact).
        Call it under the collector's claim: no save can name a piece meanwhile."""
        async with redis_errors():
            if not await self._redis.exists(self._k.refs_ok(tenant)):
                return {}
            raw = text_map(await self._redis.hgetall(self._k.unnamed(tenant)))
            if not raw:
                return {}
            counts = await self._redis.hmget(self._k.refs(tenant), list(raw))
        out, named = {}, []
        for (piece, size), count in zip(raw.items(), counts, strict=True):
            if count is None or int(count) <= 0:
                out[piece] = int(size)
            else:
                named.append(piece)  # named again by a save since it reached 0
        if named:
            async with redis_errors():
                await self._redis.hdel(self._k.unnamed(tenant), *named)
        return out

    async def trusted(self, tenant: str) -> bool:
        """Whether the tenant's counts are exact (a full collection rebuilt them since Redis began)."""
        async with redis_errors():
            return bool(await self._redis.exists(self._k.refs_ok(tenant)))

    async def forget(self, tenant: str, pieces: list[str]) -> None:
        """The pieces were deleted: drop their counts and candidacy."""
        if pieces:
            async with redis_errors(), self._redis.pipeline(transaction=True) as pipe:
                pipe.hdel(self._k.refs(tenant), *pieces)
                pipe.hdel(self._k.unnamed(tenant), *pieces)
                await pipe.execute()

    async def reset_refs(
        self, tenant: str, counts: Mapping[str, int], manifests: list[str], *, exact: bool = True
    ) -> None:
        """Counts of the listed ``manifests`` from a full collection (under the claim); trusted only
        when ``exact`` (every manifest was readable)."""
        k = self._k
        async with redis_errors(), self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(k.refs(tenant), k.unnamed(tenant), k.refs_ok(tenant), k.manifests(tenant))
            if counts:
                pipe.hset(k.refs(tenant), mapping=dict(counts))
            if manifests:
                pipe.sadd(k.manifests(tenant), *manifests)
            if exact:
                pipe.set(self._k.refs_ok(tenant), 1)
            await pipe.execute()

    # -- stored bytes -----------------------------------------------------------------------------
    async def add_bytes(self, tenant: str, delta: int) -> None:
        if delta:
            async with redis_errors():
                await self._redis.incrby(self.keys.stored_bytes(tenant), delta)

    async def set_bytes(self, tenant: str, total: int) -> None:
        async with redis_errors():
            await self._redis.set(self.keys.stored_bytes(tenant), total)

    async def epoch(self, tenant: str) -> int:
        async with redis_errors():
            return int(await self._redis.get(self._k.epoch(tenant)) or 0)


@dataclass
class CollectorClaim:
    ledger: ChunkLedger
    tenant: str
    token: str

    async def hold(self) -> None:
        """Renew the claim (between phases); :class:`LockLost` if it lapsed — stop deleting."""
        await self.ledger._hold(self)

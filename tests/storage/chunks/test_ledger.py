"""storage.chunks.ledger on a real redis-server and on the in-process default: save leases against the
collector (both ways), lapsed leases, epochs, reference counts and the stored-bytes counter.

Time is injected: the ledger's clock and sleep are a fake that advances when the ledger sleeps, so
waits of minutes run in milliseconds and nothing sleeps to wait for a condition."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from contextlib import AsyncExitStack
from typing import Any, TypeVar

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from storage.chunks.ledger import ChunkLedger, LedgerKeys
from storage.errors import LockBusy, LockLost, StoreUnavailable
from storage.index.keyspace import Keyspace

T = TypeVar("T")
PREFIX = "sk"
KEYS = LedgerKeys(Keyspace(PREFIX))


class FakeTime:
    """The ledger's clock and sleep: sleeping advances the clock and yields to the loop once.
    ``sleeping`` is set whenever someone sleeps (the ledger is waiting for something)."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now
        self.slept: list[float] = []
        self.sleeping = asyncio.Event()

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        self.sleeping.set()
        await asyncio.sleep(0)


def make_ledger(redis: Any, t: FakeTime, **kw: Any) -> ChunkLedger:
    opts: dict[str, Any] = {"lease_s": 60.0, "collect_s": 60.0, "wait_s": 30.0} | kw
    return ChunkLedger(redis, prefix=PREFIX, clock=t.clock, sleep=t.sleep, **opts)


@pytest.fixture
def t() -> FakeTime:
    return FakeTime()


@pytest.fixture
def ledger(redis_client: Any, t: FakeTime) -> ChunkLedger:
    return make_ledger(redis_client, t)


async def within(aw: Awaitable[T], what: str, timeout_s: float = 10.0) -> T:
    """Await with a deadline that fails loudly (a hang is a bug, not a slow test)."""
    try:
        return await asyncio.wait_for(aw, timeout_s)
    except TimeoutError:
        raise AssertionError(f"{what}: not done after {timeout_s}s") from None


async def savers(redis: Any, tenant: str = "acme") -> int:
    return int(await redis.zcard(KEYS.savers(tenant)))


# --------------------------------------------------------------------------------- saves vs collector
async def test_a_save_waits_for_the_collector_then_goes_on(ledger: ChunkLedger, t: FakeTime) -> None:
    async def save() -> int:
        async with ledger.saving("acme") as lease:
            return lease.epoch

    async with ledger.collecting("acme"):
        task = asyncio.create_task(save())
        await within(t.sleeping.wait(), "the save waiting")
        assert not task.done()
        assert await savers(ledger._redis) == 0  # no lease was taken meanwhile
    assert await within(task, "the save") == 1  # it started after the collection: the new epoch
    assert await savers(ledger._redis) == 0  # and its lease went with its block


async def test_a_save_gives_up_with_lock_busy(redis_client: Any, t: FakeTime) -> None:
    ledger = make_ledger(redis_client, t, wait_s=5.0)
    async with ledger.collecting("acme"):
        start = t.now
        with pytest.raises(LockBusy):
            async with ledger.saving("acme"):
                pytest.fail("a save ran beside the collector")
        assert 5.0 <= t.now - start <= 5.0 + 0.5  # waited wait_s, backing off to at most 0.5 s
        assert max(t.slept) == 0.5 and t.slept[0] == 0.005
    assert await savers(redis_client) == 0
    async with ledger.saving("acme") as lease:  # the collector gone, saves go in at once
        assert lease.epoch == 1


async def test_the_collector_waits_for_live_saves(redis_client: Any, t: FakeTime) -> None:
    ledger = make_ledger(redis_client, t)
    other = make_ledger(redis_client, FakeTime(t.now), wait_s=1.0)  # another process
    claimed = asyncio.Event()

    async def collect() -> None:
        async with ledger.collecting("acme"):
            claimed.set()

    async with ledger.saving("acme") as lease:
        task = asyncio.create_task(collect())
        await within(t.sleeping.wait(), "the collector waiting")
        assert not claimed.is_set()
        # a collector that waits already holds new saves back
        with pytest.raises(LockBusy):
            async with other.saving("acme"):
                pytest.fail("a save started while the collector waited")
        await lease.check(margin_s=0)  # the live save keeps its lease meanwhile
    await within(task, "the collection")
    assert claimed.is_set()
    assert await ledger.epoch("acme") == 1


async def test_the_collector_gives_up_with_lock_busy_and_lets_saves_in(
    redis_client: Any, t: FakeTime
) -> None:
    ledger = make_ledger(redis_client, t, drain_s=3.0)
    async with ledger.saving("acme") as lease:
        start = t.now
        with pytest.raises(LockBusy):
            async with ledger.collecting("acme"):
                pytest.fail("the collector ran beside a save")
        assert 3.0 <= t.now - start <= 3.5
        assert await redis_client.exists(KEYS.collector("acme")) == 0  # the claim was given back
        await lease.check(margin_s=0)
        t.slept.clear()
        async with ledger.saving("acme") as second:  # a second save is not held back
            assert t.slept == [] and second.epoch == 0
    assert await ledger.epoch("acme") == 0  # nothing was collected


async def test_a_second_collector_is_refused_at_once(ledger: ChunkLedger, t: FakeTime) -> None:
    async with ledger.collecting("acme"):
        with pytest.raises(LockBusy):
            async with ledger.collecting("acme"):
                pytest.fail("two collectors")
        assert t.slept == []
    async with ledger.collecting("acme"):
        pass
    assert await ledger.epoch("acme") == 2


async def test_tenants_and_prefixes_are_independent(redis_client: Any, t: FakeTime) -> None:
    ledger = make_ledger(redis_client, t, wait_s=0.0)
    elsewhere = ChunkLedger(redis_client, prefix="other", clock=t.clock, sleep=t.sleep, wait_s=0.0)
    async with ledger.collecting("acme"):
        async with ledger.saving("globex") as lease, elsewhere.saving("acme") as lease2:
            assert lease.epoch == 0 and lease2.epoch == 0
        async with ledger.collecting("globex"), elsewhere.collecting("acme"):
            pass
    assert t.slept == []
    assert [await ledger.epoch("acme"), await ledger.epoch("globex"), await elsewhere.epoch("acme")] == [
        1,
        1,
        1,
    ]


async def test_a_collector_claim_whose_release_redis_missed_is_released_once_it_answers(
    redis_client: Any, t: FakeTime, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = make_ledger(redis_client, t)
    real, tries = ledger._release, []

    async def cut_off_twice(claim: Any, bump: bool = True) -> None:
        tries.append(t.now)
        if len(tries) <= 2:
            raise StoreUnavailable("redis: cut off")
        await real(claim, bump)

    monkeypatch.setattr(ledger, "_release", cut_off_twice)
    with pytest.raises(StoreUnavailable):
        async with ledger.collecting("acme"):
            pass
    assert await redis_client.exists(KEYS.collector("acme"))  # left, it would hold saves back
    await within(asyncio.gather(*ledger._releasing), "the claim's late release")
    assert not await redis_client.exists(KEYS.collector("acme")) and len(tries) == 3
    async with ledger.saving("acme"):  # saves go in again at once
        pass


# -------------------------------------------------------------------------------------- lapsed leases
async def test_a_lease_whose_end_redis_missed_ends_once_it_answers(
    redis_client: Any, t: FakeTime, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = make_ledger(redis_client, t)
    real, tries = redis_client.zrem, []

    async def cut_off_twice(*args: Any) -> Any:
        tries.append(t.now)
        if len(tries) <= 2:
            raise RedisConnectionError("cut off")
        return await real(*args)

    monkeypatch.setattr(redis_client, "zrem", cut_off_twice)
    with pytest.raises(StoreUnavailable):
        async with ledger.saving("acme"):
            pass
    assert await savers(redis_client) == 1  # left behind, it would hold every collector back
    await within(asyncio.gather(*ledger._releasing), "the lease's late end")
    assert await savers(redis_client) == 0 and len(tries) == 3
    assert tries[-1] - tries[0] < ledger.lease_s  # long before it would have lapsed


async def test_an_expired_lease_does_not_block_the_collector(redis_client: Any, t: FakeTime) -> None:
    ledger = make_ledger(redis_client, t, lease_s=10.0)
    async with AsyncExitStack() as dead:
        lease = await dead.enter_async_context(ledger.saving("acme"))  # a saver that stopped
        t.now += 10.5
        t.slept.clear()
        async with ledger.collecting("acme"):
            assert t.slept == []  # no wait for the dead saver
            assert await savers(redis_client) == 0  # its lease was dropped
        with pytest.raises(LockLost):
            await lease.check(margin_s=0)


async def test_a_live_lease_blocks_the_collector_until_it_lapses(redis_client: Any, t: FakeTime) -> None:
    ledger = make_ledger(redis_client, t, lease_s=10.0, drain_s=2.0)
    patient = make_ledger(redis_client, t, lease_s=10.0, drain_s=30.0)
    start = t.now
    async with ledger.saving("acme") as lease:
        t.now += 5.0
        with pytest.raises(LockBusy):
            async with ledger.collecting("acme"):
                pytest.fail("collected beside a live save")
        await lease.check(margin_s=0)
        async with patient.collecting("acme"):  # waits (on the fake clock) until the lease lapsed
            assert start + 10.0 <= t.now <= start + 10.5
        with pytest.raises(LockLost):
            await lease.check(margin_s=0)  # the saver learns it before committing


async def test_check_raises_lock_lost_after_expiry(redis_client: Any, t: FakeTime) -> None:
    ledger = make_ledger(redis_client, t, lease_s=60.0)
    start = t.now
    async with ledger.saving("acme") as lease:
        assert lease.expires_ms == int(start * 1000) + 60_000
        await lease.check()
        t.now = start + 29.0
        await lease.check(margin_s=30)
        t.now = start + 31.0
        with pytest.raises(LockLost):
            await lease.check(margin_s=30)  # it holds, but not for 30 s more
        await lease.check(margin_s=0)
        t.now = start + 60.5
        with pytest.raises(LockLost):
            await lease.check(margin_s=0)
    t.now = start
    with pytest.raises(LockLost):
        await lease.check(margin_s=0)  # the block ended: the lease is gone


@pytest.mark.parametrize(("lease_s", "margin_s"), [(60.0, 15.0), (600.0, 30.0), (8.0, 2.0)])
async def test_check_default_margin(redis_client: Any, t: FakeTime, lease_s: float, margin_s: float) -> None:
    """Without a margin, check() wants a quarter of the lease left, at most 30 s (so a short lease
    can still commit)."""
    ledger = make_ledger(redis_client, t, lease_s=lease_s)
    start = t.now
    async with ledger.saving("acme") as lease:
        t.now = start + lease_s - margin_s - 0.5
        await lease.check()
        t.now = start + lease_s - margin_s + 0.5
        with pytest.raises(LockLost):
            await lease.check()
        await lease.check(margin_s=0)


async def test_a_lease_dropped_by_a_collector_elsewhere_is_lost(redis_client: Any, t: FakeTime) -> None:
    """A collector whose clock is ahead drops a lease the saver thinks it still holds: the saver's
    check must fail then, whatever its own clock says."""
    ledger = make_ledger(redis_client, t, lease_s=10.0)
    ahead = make_ledger(redis_client, FakeTime(t.now + 11.0), lease_s=10.0)
    async with ledger.saving("acme") as lease:
        async with ahead.collecting("acme"):
            pass
        with pytest.raises(LockLost):
            await lease.check(margin_s=0)


# --------------------------------------------------------------------------------------------- epochs
async def test_epoch_bumps_after_each_collection(ledger: ChunkLedger) -> None:
    assert await ledger.epoch("acme") == 0
    async with ledger.saving("acme") as lease:
        assert lease.epoch == 0
    async with ledger.collecting("acme"):
        assert await ledger.epoch("acme") == 0  # not before it is over
    assert await ledger.epoch("acme") == 1
    with pytest.raises(RuntimeError):
        async with ledger.collecting("acme"):
            raise RuntimeError("collection failed half way")  # pieces may be gone: still a new epoch
    assert await ledger.epoch("acme") == 2
    assert await ledger._redis.exists(KEYS.collector("acme")) == 0
    async with ledger.saving("acme") as lease:
        assert lease.epoch == 2
    assert await ledger.epoch("globex") == 0


async def test_hold_renews_and_detects_a_lapsed_claim(redis_client: Any, t: FakeTime) -> None:
    ledger = make_ledger(redis_client, t, collect_s=100.0)
    key = KEYS.collector("acme")
    first = AsyncExitStack()
    claim = await first.enter_async_context(ledger.collecting("acme"))
    await redis_client.pexpire(key, 1000)
    await claim.hold()
    assert 90_000 < await redis_client.pttl(key) <= 100_000  # renewed to collect_s
    await redis_client.delete(key)  # the claim ran out (PX) ...
    second = AsyncExitStack()
    other = await second.enter_async_context(ledger.collecting("acme"))  # ... and another collector came
    with pytest.raises(LockLost):
        await claim.hold()
    await first.aclose()  # the first collector's end must not release the second's claim
    await other.hold()
    assert await redis_client.get(key) in (other.token, other.token.encode())
    await second.aclose()
    assert await redis_client.exists(key) == 0


# ---------------------------------------------------------------------------------- stored bytes
async def test_stored_bytes_counter(ledger: ChunkLedger, redis_client: Any) -> None:
    key = Keyspace(PREFIX).stored_bytes("acme")
    await ledger.add_bytes("acme", 0)
    assert await redis_client.exists(key) == 0
    await ledger.add_bytes("acme", 1000)
    await ledger.add_bytes("acme", -300)
    assert int(await redis_client.get(key)) == 700
    await ledger.set_bytes("acme", 42)
    await ledger.add_bytes("acme", 8)
    assert int(await redis_client.get(key)) == 50
    assert await redis_client.exists(Keyspace(PREFIX).stored_bytes("globex")) == 0


# ----------------------------------------------------------------------------------- reference counts
async def test_reference_counts(ledger: ChunkLedger) -> None:
    a, b = {"ns/a.kv": 100, "ns/b.ck": 7}, {"ns/a.kv": 100}
    await ledger.name("acme", "m/a", a)
    await ledger.name("acme", "m/b", b)
    await ledger.unname("acme", "m/a", a)
    assert await ledger.unnamed("acme") == {}  # counts not known to be exact yet
    # a full collection found one manifest (m/b) naming a
    await ledger.reset_refs("acme", {"ns/a.kv": 1}, ["m/b"])
    assert await ledger.unnamed("acme") == {}
    await ledger.unname("acme", "m/b", b)
    assert await ledger.unnamed("acme") == {"ns/a.kv": 100}
    await ledger.name("acme", "m/c", b)  # named again (by another manifest) before the collector came
    assert await ledger.unnamed("acme") == {}
    await ledger.unname("acme", "m/c", b)
    assert await ledger.unnamed("acme") == {"ns/a.kv": 100}
    await ledger.forget("acme", ["ns/a.kv"])
    assert await ledger.unnamed("acme") == {}
    await ledger.name("acme", "m/d", b)
    await ledger.unname("acme", "m/d", b)
    await ledger.reset_refs("acme", {}, [], exact=False)  # an unreadable manifest: counts not trusted
    assert await ledger.unnamed("acme") == {}
    await ledger.name("acme", "m/e", b)
    await ledger.unname("acme", "m/e", b)
    assert await ledger.unnamed("acme") == {}
    await ledger.name("acme", "m/f", {})
    await ledger.unname("acme", "m/f", {})


async def refs(redis: Any, tenant: str = "acme") -> dict[str, int]:
    raw = await redis.hgetall(KEYS.refs(tenant))
    return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}


async def test_a_manifest_is_counted_once(ledger: ChunkLedger, redis_client: Any) -> None:
    """Naming one manifest twice (a save retried after a lost answer) counts it once; deleting it
    twice (two deleters at once) takes its counts back once."""
    await ledger.reset_refs("acme", {}, [])
    pieces = {"ns/a.kv": 100, "ns/b.ck": 7}
    await ledger.name("acme", "m/1", pieces)
    await ledger.name("acme", "m/1", pieces)
    await ledger.name("acme", "m/2", {"ns/a.kv": 100})
    assert await refs(redis_client) == {"ns/a.kv": 2, "ns/b.ck": 1}
    await ledger.unname("acme", "m/1", pieces)
    await ledger.unname("acme", "m/1", pieces)
    assert await refs(redis_client) == {"ns/a.kv": 1, "ns/b.ck": 0}
    assert await ledger.unnamed("acme") == {"ns/b.ck": 7}  # a is still named by m/2
    await ledger.unname("acme", "m/never-named", pieces)  # a manifest the ledger never counted
    assert await refs(redis_client) == {"ns/a.kv": 1, "ns/b.ck": 0}
    await asyncio.gather(*(ledger.unname("acme", "m/2", {"ns/a.kv": 100}) for _ in range(5)))
    assert await refs(redis_client) == {"ns/a.kv": 0, "ns/b.ck": 0}
    assert await ledger.unnamed("acme") == {"ns/a.kv": 100, "ns/b.ck": 7}


async def test_an_unname_after_a_collection_that_did_not_count_the_manifest(
    ledger: ChunkLedger, redis_client: Any
) -> None:
    """A delete whose manifest a full collection no longer found (gone before the listing was read)
    must not take counts back from the rebuilt, exact counts."""
    piece = {"ns/a.kv": 100}
    await ledger.name("acme", "m/1", piece)
    await ledger.name("acme", "m/2", piece)
    await ledger.reset_refs("acme", {"ns/a.kv": 1}, ["m/2"])  # m/1's manifest was already gone
    await ledger.unname("acme", "m/1", piece)  # its delete's late unname
    assert await refs(redis_client) == {"ns/a.kv": 1}
    assert await ledger.unnamed("acme") == {}
    await ledger.unname("acme", "m/2", piece)
    assert await ledger.unnamed("acme") == {"ns/a.kv": 100}


async def test_a_manifest_without_pieces_is_uncounted_by_its_delete(ledger: ChunkLedger) -> None:
    """A generation naming no piece (a short session with checkpoints off: only its tail) is
    deleted, and the key is saved again naming pieces: they must be counted."""
    await ledger.reset_refs("acme", {}, [])
    await ledger.name("acme", "m/1", {})
    await ledger.unname("acme", "m/1", {})
    await ledger.name("acme", "m/1", {"ns/a.kv": 100})
    await ledger.name("acme", "m/2", {"ns/a.kv": 100})
    await ledger.unname("acme", "m/2", {"ns/a.kv": 100})
    assert await ledger.unnamed("acme") == {}  # m/1 still names it


async def test_trusted_follows_full_collections(ledger: ChunkLedger) -> None:
    assert not await ledger.trusted("acme")  # a new Redis: counts unknown
    await ledger.reset_refs("acme", {"ns/a.kv": 1}, ["m/1"])
    assert await ledger.trusted("acme") and not await ledger.trusted("globex")
    await ledger.reset_refs("acme", {"ns/a.kv": 1}, ["m/1"], exact=False)
    assert not await ledger.trusted("acme")


# ------------------------------------------------------------------------------------ write claims
async def test_one_writer_per_generation(ledger: ChunkLedger, redis_client: Any) -> None:
    token = await ledger.claim_write("acme", "m/1")
    assert token
    assert await ledger.claim_write("acme", "m/1") is None
    assert await ledger.claim_write("acme", "m/2") and await ledger.claim_write("globex", "m/1")
    ttl = await redis_client.pttl(KEYS.writing("acme") + "m/1")
    assert 0 < ttl <= (ledger.wait_s + ledger.lease_s) * 1000  # a dead writer frees it after wait + lease
    await ledger.release_write("acme", "m/1", "not-the-token")
    assert await ledger.claim_write("acme", "m/1") is None  # only its holder releases it
    await ledger.release_write("acme", "m/1", token)
    again = await ledger.claim_write("acme", "m/1")
    assert again and again != token
    await ledger.release_write("acme", "m/1", token)  # a stale release does not free the new claim
    assert await ledger.claim_write("acme", "m/1") is None


async def test_concurrent_claims_of_one_generation(ledger: ChunkLedger) -> None:
    tokens = await asyncio.gather(*(ledger.claim_write("acme", "m/1") for _ in range(10)))
    assert sum(t is not None for t in tokens) == 1


# ------------------------------------------------------------------------------- exclusion, concurrently
async def test_saves_and_collections_never_overlap(redis_client: Any) -> None:
    """Many savers and two collectors on one tenant, in real time (sleeps shortened 100x): no
    collection's claim ever covers a moment inside a save's block."""
    events: list[tuple[str, str, int]] = []
    tick = iter(range(10**9))

    async def fast(seconds: float) -> None:
        await asyncio.sleep(seconds / 100)

    def ledger() -> ChunkLedger:
        return ChunkLedger(redis_client, prefix=PREFIX, lease_s=60, collect_s=60, wait_s=60, sleep=fast)

    async def saver(i: int) -> None:
        led = ledger()
        for j in range(6):
            async with led.saving("acme") as lease:
                events.append(("s", f"{i}.{j}+", next(tick)))
                await asyncio.sleep(0)
                await lease.check()
                events.append(("s", f"{i}.{j}-", next(tick)))
            await asyncio.sleep(0)

    async def collector(i: int) -> None:
        led = ledger()
        done = 0
        while done < 3:
            try:
                async with led.collecting("acme"):
                    events.append(("c", f"{i}+", next(tick)))
                    await asyncio.sleep(0)
                    events.append(("c", f"{i}-", next(tick)))
                done += 1
            except LockBusy:
                await asyncio.sleep(0)  # the other collector had it: try again

    await within(
        asyncio.gather(*(saver(i) for i in range(8)), collector(0), collector(1)), "the workload", 60
    )
    inside_save, inside_collect = 0, 0
    for kind, what, _ in events:
        if kind == "s":
            inside_save += 1 if what.endswith("+") else -1
        else:
            inside_collect += 1 if what.endswith("+") else -1
        assert inside_collect <= 1 and not (inside_collect and inside_save), events
    assert sum(1 for k, w, _ in events if k == "c" and w.endswith("+")) == 6
    assert await ChunkLedger(redis_client, prefix=PREFIX).epoch("acme") == 6

"""The index's epoch: how a lost or flushed index is noticed, and who rebuilds it.

Three keys under the prefix:

* ``index:epoch`` — a random token, written by the first process to find none (``SET NX``). A
  redis-server restarted empty, or a ``FLUSHALL``, takes it away with everything else, so a reader
  that finds it missing, or different from the one it knew, knows the index it relied on is gone.
* ``index:built`` — the epoch whose index has been rebuilt from the store: while it differs from
  ``index:epoch`` the index is *healing* (records may still be missing).
* ``index:rebuilding`` — a lease (``SET NX PX``) held by the one process that rebuilds.

The opening read of every turn (:mod:`storage.index.turnops`) returns the first two, so noticing
costs no round trip of its own; :func:`index_state` is the verdict on them.

A failover loses no key outright but may lose the last writes of every key of its shard: a
replica promoted (Redis Cluster, Sentinel, a managed Redis behind one address) answers with what it
had replicated. The epoch survives it, so it is noticed otherwise: every primary names its
replication history (``master_replid``, new whenever a replica is promoted or a server starts
afresh), and a process that sees a primary with a history it never saw before renews the epoch
(:meth:`IndexEpoch.renew`): every process then heals as for a loss, and healing only ever adds
what the store and the slots know newer than the index.
"""

from __future__ import annotations

import enum
import secrets
from typing import Any

from storage.index.keyspace import Keyspace, redis_errors, text
from storage.index.scripts import IndexScripts

# Set ``index:built`` to the epoch only while the epoch is still that one (not lost again meanwhile)
# and the rebuilding lease is still ours, then give the lease back.
_BUILT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[1])
if redis.call('GET', KEYS[3]) == ARGV[2] then redis.call('DEL', KEYS[3]) end
return 1
"""
# Replace the epoch by a new one if it is still the one the caller knows; the epoch as it is now.
_RENEW = """
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then redis.call('SET', KEYS[1], ARGV[2]) return ARGV[2] end
return current or ''
"""
# Take the rebuilding lease for an epoch that is still the index's and not yet built.
_TAKE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 'moved' end
if redis.call('GET', KEYS[2]) == ARGV[1] then return 'built' end
if redis.call('SET', KEYS[3], ARGV[2], 'NX', 'PX', ARGV[3]) then return 'taken' end
return 'held'
"""
_GIVE_BACK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""


class IndexState(enum.Enum):
    READY = "ready"  # the epoch this process knows, rebuilt
    LOST = "lost"  # no epoch: the index was emptied since it was last read
    CHANGED = "changed"  # another epoch than the one this process knows: another process saw a loss
    HEALING = "healing"  # the known epoch, not yet rebuilt


def index_state(known: str | None, epoch: str, built: str) -> IndexState:
    """The verdict on an epoch read (``''``: the key is missing) by a process that knows ``known``."""
    if not epoch:
        return IndexState.LOST
    if epoch != known:
        return IndexState.CHANGED
    return IndexState.READY if built == epoch else IndexState.HEALING


class Lease(enum.Enum):
    """What asking for the rebuilding lease of an epoch found."""

    TAKEN = "taken"  # this process rebuilds
    HELD = "held"  # another process rebuilds: wait for it (or for its lease to lapse)
    BUILT = "built"  # the epoch is rebuilt already (perhaps just now, by another process)
    MOVED = "moved"  # the epoch is no longer the index's: claim again


class IndexEpoch(IndexScripts):
    """The three keys of the module doc, on one Redis client (share it: it keeps no state)."""

    def __init__(self, redis: Any, *, prefix: str = "slotkeeper") -> None:
        self._redis = redis
        keys = Keyspace(prefix)
        self.epoch_key, self.built_key = keys.index_epoch(), keys.index_built()
        self.lease_key = keys.index_lease()
        self._scripts: dict[str, Any] = {}

    async def read(self) -> tuple[str, str]:
        """The epoch and the built epoch, ``''`` for a missing key."""
        async with redis_errors():
            epoch, built = await self._redis.mget(self.epoch_key, self.built_key)
        return text(epoch) if epoch else "", text(built) if built else ""

    async def claim(self) -> tuple[str, bool]:
        """The current epoch, written first when there is none; and whether this call wrote it."""
        token = secrets.token_hex(16)
        async with redis_errors():
            created = bool(await self._redis.set(self.epoch_key, token, nx=True))
            current = token if created else await self._redis.get(self.epoch_key)
        return (text(current) if current else ""), created

    async def take_lease(self, epoch: str, ttl_s: float) -> tuple[Lease, str]:
        """Ask for the rebuilding lease of ``epoch``, in one step with the check that it is still
        the index's epoch and not built yet (a lease given back by a process that just marked it
        built must not start a second rebuild); the answer, and the lease's token when TAKEN."""
        token = secrets.token_hex(16)
        async with redis_errors():
            answer = await self._script("take", _TAKE)(
                keys=[self.epoch_key, self.built_key, self.lease_key],
                args=[epoch, token, max(1, round(ttl_s * 1000))],
            )
        return Lease(text(answer)), token

    async def mark_built(self, epoch: str, lease: str) -> bool:
        """Record ``epoch`` as rebuilt and give ``lease`` back, in one step; False when the epoch is
        no longer the index's (it was lost again during the rebuild: the caller starts over)."""
        async with redis_errors():
            done = await self._script("built", _BUILT)(
                keys=[self.epoch_key, self.built_key, self.lease_key], args=[epoch, lease]
            )
        return bool(int(done))

    async def renew(self, known: str) -> str:
        """A new epoch in place of ``known`` unless another process changed it already (then that
        one): every process that relied on the index as it was heals it (see the module doc)."""
        renew = self._script("renew", _RENEW)
        async with redis_errors():
            return text(await renew(keys=[self.epoch_key], args=[known, secrets.token_hex(16)]))

    async def histories(self) -> frozenset[str]:
        """The replication histories (``master_replid``) of the index's primaries now: one, or one
        per Redis Cluster shard; empty where no server says (the in-process index)."""
        from storage.index.topology import is_cluster

        if type(self._redis).__module__.startswith("fakeredis"):
            return frozenset()
        async with redis_errors():
            if is_cluster(self._redis):
                replies = await self._redis.info("replication", target_nodes=self._redis.PRIMARIES)
                infos = list(replies.values()) if "master_replid" not in replies else [replies]
            else:
                infos = [await self._redis.info("replication")]
        return frozenset(str(i["master_replid"]) for i in infos if i.get("role") == "master")

    async def give_lease(self, lease: str) -> None:
        """Give the rebuilding lease back unbuilt (the rebuild failed), if it is still ours."""
        async with redis_errors():
            await self._script("give_back", _GIVE_BACK)(keys=[self.lease_key], args=[lease])

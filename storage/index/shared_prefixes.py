"""Shared prefixes: a digest of the prefix an agent's sessions share → a session holding its state.

Every session an agent starts renders the same tools and system prompt first, and the engines keep
a checkpoint where that prefix ends. After each turn the gateway points the prefix's digest
(``gateway.turn.prompt.shared_digest``) at the session (``pp`` key, with the route TTL: the newest
session to reach the prefix wins, and a prefix nobody uses goes by itself). A new session looks the
digest up (:meth:`SharedPrefixes.find_shared`) and starts from that session's state: copied from
its slot on the same engine, or restored from its stored generation up to the prefix. The key is
under the tenant's namespace, so a hit from another tenant cannot be spelled.
"""

from __future__ import annotations

from typing import Any

from storage.ids import validate_id
from storage.index.keyspace import Keyspace, redis_errors
from storage.index.prefix_digests import validate_digest
from storage.index.records import SessionRecord
from storage.index.scripts import IndexScripts

# KEYS[1]: the digest's key. ARGV[1]: the tenant's session-key prefix. Returns {session, record
# fields...} of the session it names while that session has a record, else nil.
_FIND = """
local session = redis.call('GET', KEYS[1])
if not session then return nil end
local record = redis.call('HGETALL', ARGV[1] .. session)
if #record == 0 then return nil end
table.insert(record, 1, session)
return record
"""


class SharedPrefixes(IndexScripts):
    """The shared-prefix part of :class:`storage.index.session_index.SessionIndex` (a mixin: it uses
    the index's client, keyspace, ``route_ttl_ms`` and scripts)."""

    keys: Keyspace
    route_ttl_ms: int

    def queue_shared(self, pipe: Any, tenant: str, session: str, digest: str) -> None:
        """Point the shared prefix ``digest`` at ``session`` for the route TTL (queued on a pipeline
        in MULTI or on :class:`storage.index.turnops.Ops`, to ride along with the turn's bookkeeping)."""
        key = self.keys.shared_prefix(tenant, validate_digest(digest))
        pipe.set(key, validate_id(session, "session id"), px=self.route_ttl_ms)

    async def add_shared(self, tenant: str, session: str, digest: str) -> None:
        """:meth:`queue_shared` on its own."""
        async with redis_errors(), self._redis.pipeline(transaction=True) as pipe:
            self.queue_shared(pipe, tenant, session, digest)
            await pipe.execute()

    async def find_shared(self, tenant: str, digest: str) -> SessionRecord | None:
        """The record of the session the shared prefix ``digest`` points at (one round trip), or
        None when there is none or it was deleted."""
        script = self._script("shared", _FIND)
        key = self.keys.shared_prefix(tenant, validate_digest(digest))
        async with redis_errors():
            found = await script(keys=[key], args=[self.keys.session_prefix(tenant)])
        if not found:
            return None
        values = [v.decode() if isinstance(v, bytes) else str(v) for v in found]
        fields = dict(zip(values[1::2], values[2::2], strict=True))
        return SessionRecord.from_hash(tenant, values[0], fields)

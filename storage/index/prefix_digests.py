"""Implicit routing: message-prefix digests → the session that holds that conversation.

A digest key (``px``) names one session; a per-session set (``sx``) lists the digests recorded
for it, so that deleting the session takes its routes along (only those still pointing at it: a
digest re-pointed to another session stays). Both expire ``ttl_s`` after the last
:meth:`PrefixRouting.add_prefixes` for the session — a conversation nobody continues stops being routable
and its keys go by themselves; every turn re-adds its history's digests and so refreshes them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from storage.errors import InvalidId
from storage.ids import validate_id
from storage.index.keyspace import Keyspace, redis_errors, text

_DIGEST = re.compile(r"[0-9a-f]{16,128}")
DEFAULT_ROUTE_TTL_S = 7 * 24 * 3600.0
# What a save stores of a session's routing digests (with its slot file or manifest, for reindex):
# its conversation's route, then its shared prefix's digest after a dot, its last prompt's after a
# plus (both storage.index.shared_prefixes) and its last turn's head after a dash (gateway.turn.branch).
STORED_ROUTES = re.compile(r"[0-9a-f]{16,128}(\.[0-9a-f]{16,128})?(\+[0-9a-f]{16,128})?(-[0-9a-f]{16,128})?")


def join_routes(route: str, shared: str, prompt: str = "", head: str = "") -> str:
    """The stored form of a session's routes; the other digests are kept only beside a route (a
    session has one once a turn of it finished, and only then the others)."""
    if not route:
        return ""
    return (
        route
        + (f".{shared}" if shared else "")
        + (f"+{prompt}" if prompt else "")
        + (f"-{head}" if head else "")
    )


def split_routes(stored: str) -> tuple[str, str, str, str]:
    """(route, shared prefix's digest, last prompt's digest, last head) of a stored form ("" for
    what it lacks; a form stored before prompts or heads were recorded has none)."""
    stored, _, head = stored.partition("-")
    routes, _, prompt = stored.partition("+")
    route, _, shared = routes.partition(".")
    return route, shared, prompt, head


# KEYS: the digests' route keys, longest prefix first. ARGV[1]: the tenant's session-key prefix
# (`Keyspace.session_prefix`). Returns {index, session} of the first route whose session still
# has a record, or nil.
_MATCH = """
for i, key in ipairs(KEYS) do
  local session = redis.call('GET', key)
  if session and redis.call('EXISTS', ARGV[1] .. session) == 1 then return {i, session} end
end
return nil
"""


def validate_digest(digest: str) -> str:
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise InvalidId("prefix digest", "must be 16-128 lowercase hex characters")
    return digest


def route_ttl_ms(ttl_s: float) -> int:
    if not ttl_s > 0:
        raise ValueError("route ttl must be > 0")
    return max(1, round(ttl_s * 1000))


class PrefixRouting:
    """The routing part of :class:`storage.index.session_index.SessionIndex` (a mixin: it uses the index's
    client, keyspace and ``route_ttl_ms``)."""

    _redis: Any
    keys: Keyspace
    route_ttl_ms: int
    _scripts: dict[str, Any]

    async def add_prefixes(self, tenant: str, session: str, digests: Iterable[str]) -> None:
        """Route these message-prefix digests (lowercase hex) to ``session`` for the route TTL,
        and refresh the TTL of the session's set of routes."""
        async with redis_errors(), self._redis.pipeline(transaction=True) as pipe:
            self.queue_prefixes(pipe, tenant, session, digests)
            await pipe.execute()

    def queue_prefixes(self, pipe: Any, tenant: str, session: str, digests: Iterable[str]) -> None:
        """:meth:`add_prefixes`'s writes, queued on a pipeline in MULTI or on
        :class:`storage.index.turnops.Ops` (to ride along with a guarded transition)."""
        digests = [validate_digest(d) for d in digests]
        session = validate_id(session, "session id")
        routes = self.keys.session_prefixes(tenant, session)
        for digest in digests:
            pipe.set(self.keys.prefix_hash(tenant, digest), session, px=self.route_ttl_ms)
        if digests:
            pipe.sadd(routes, *digests)
        pipe.pexpire(routes, self.route_ttl_ms)

    async def match_prefix(self, tenant: str, digests: Sequence[str]) -> tuple[str, str] | None:
        """The first of ``digests`` (pass the longest prefix first) routed to a session that still
        has a record; one round trip (a script) whatever the number of digests."""
        if not digests:
            return None
        keys = [self.keys.prefix_hash(tenant, validate_digest(d)) for d in digests]
        script = self._scripts.get("match") or self._scripts.setdefault(
            "match", self._redis.register_script(_MATCH)
        )
        async with redis_errors():
            found = await script(keys=keys, args=[self.keys.session_prefix(tenant)])
        if not found:
            return None
        return digests[int(found[0]) - 1], text(found[1])

    async def _owned_routes(self, pipe: Any, tenant: str, session: str) -> list[str]:
        """Inside a transaction (immediate mode): WATCH and return the digest keys that still
        route to ``session`` — what deleting it must delete besides its set."""
        routes = self.keys.session_prefixes(tenant, session)
        route_keys = [self.keys.prefix_hash(tenant, text(d)) for d in await pipe.smembers(routes)]
        if not route_keys:
            return []
        await pipe.watch(*route_keys)
        targets = await pipe.execute_command("MGET", *route_keys)  # (a cluster pipeline blocks .mget)
        return [k for k, t in zip(route_keys, targets, strict=True) if t is not None and text(t) == session]

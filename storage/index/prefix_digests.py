"""Implicit routing: message-prefix digests → the session that holds that conversation.

A digest key (``px``) names one session; a per-session sorted set (``sx``) lists the routing keys
recorded for it, newest last, so that deleting the session takes them along (only those still
pointing at it: a digest re-pointed to another session stays). Besides its ``px`` routes it lists
the ``pp`` key of its last prompts' digests (a new session sending one of them again starts from
this one's state: :mod:`storage.index.shared_prefixes`). All expire ``ttl_s`` after the last
:meth:`PrefixRouting.add_prefixes` for the session — a conversation nobody continues stops being
routable and its keys go by themselves; every turn re-adds its newest digests and so refreshes them.

A session keeps its newest ``keep`` routing keys (:data:`DEFAULT_ROUTES_PER_SESSION`), whatever its
number of turns: the same script that records a turn's digests drops the older ones and deletes
their keys while they still point at it. A request is looked up by the digests of its history,
newest first, so an agent going on from its last turns finds its session; one going back further
than the kept turns starts a new session (or a branch) instead: never another conversation's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from storage.errors import InvalidId
from storage.ids import validate_id
from storage.index.keyspace import Keyspace, redis_errors, text
from storage.index.scripts import IndexScripts

if TYPE_CHECKING:
    from storage.index.turnops import Ops

_DIGEST = re.compile(r"[0-9a-f]{16,128}")
DEFAULT_ROUTE_TTL_S = 7 * 24 * 3600.0
# Routing keys kept per session: its newest complete turns, its last head and its last prompt's
# digest (gateway.turn.close). 8 lets an agent go back up to six turns and still be found.
DEFAULT_ROUTES_PER_SESSION = 8
ROUTE, PROMPT = "px:", "pp:"  # a routing key's kind, as its key names it after the tenant's part
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


# `record_routes(set, a)`: the session's routing keys recorded, newest last. ``a``: how many to keep,
# the TTL (ms), the session id, the tenant's key part (`Keyspace.tenant`), then the keys' members
# (kind + digest, oldest first). Each member's key (the tenant's part, ':', the member) is pointed at
# the session; the set's scores count up, so a member recorded again is newest again; beyond
# ``keep`` the oldest members leave the set and their keys are deleted while they name the session.
# The keys are built here from the set's tenant part: the same hash slot (`Keyspace` doc).
ROUTES_LUA = """
local function record_routes(set, a)
  local keep, ttl, session, tenant = tonumber(a[1]), a[2], a[3], a[4]
  local top = redis.call('ZRANGE', set, -1, -1, 'WITHSCORES')
  local score = top[2] and tonumber(top[2]) + 1 or 0
  for j = 5, #a do
    redis.call('SET', tenant .. ':' .. a[j], session, 'PX', ttl)
    redis.call('ZADD', set, score, a[j])
    score = score + 1
  end
  local over = redis.call('ZCARD', set) - keep
  if over > 0 then
    for _, m in ipairs(redis.call('ZRANGE', set, 0, over - 1)) do
      if redis.call('GET', tenant .. ':' .. m) == session then redis.call('DEL', tenant .. ':' .. m) end
    end
    redis.call('ZREMRANGEBYRANK', set, 0, over - 1)
  end
  redis.call('PEXPIRE', set, ttl)
end
"""
_RECORD = ROUTES_LUA + "record_routes(KEYS[1], ARGV)\n"


def routes_kept(keep: int) -> int:
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 2:
        raise ValueError("routes per session must be an int >= 2 (a turn's route and its prompt's)")
    return keep


def validate_digest(digest: str) -> str:
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise InvalidId("prefix digest", "must be 16-128 lowercase hex characters")
    return digest


def route_ttl_ms(ttl_s: float) -> int:
    if not ttl_s > 0:
        raise ValueError("route ttl must be > 0")
    return max(1, round(ttl_s * 1000))


class PrefixRouting(IndexScripts):
    """The routing part of :class:`storage.index.session_index.SessionIndex` (a mixin: it uses the index's
    client, keyspace, ``route_ttl_ms`` and ``routes_per_session``)."""

    keys: Keyspace
    route_ttl_ms: int
    routes_per_session: int

    async def add_prefixes(
        self, tenant: str, session: str, digests: Iterable[str], prompt: str | None = None
    ) -> None:
        """Route these message-prefix digests (lowercase hex, oldest first) to ``session`` for the
        route TTL, and the ``pp`` key of ``prompt`` (a prompt's digest) too, keeping the session's
        newest ``routes_per_session`` routing keys (see the module doc); one round trip (a script)."""
        key, args = self._routes(tenant, session, digests, prompt)
        script = self._script("routes", _RECORD)
        async with redis_errors():
            await script(keys=[key], args=args)

    def queue_prefixes(
        self, ops: Ops, tenant: str, session: str, digests: Iterable[str], prompt: str | None = None
    ) -> None:
        """:meth:`add_prefixes`'s write, queued on :class:`storage.index.turnops.Ops` (to ride along
        with a guarded transition)."""
        key, args = self._routes(tenant, session, digests, prompt)
        ops.routes(key, *args)

    def _routes(
        self, tenant: str, session: str, digests: Iterable[str], prompt: str | None
    ) -> tuple[str, list[Any]]:
        """The session's set of routing keys and ``record_routes``' arguments (:data:`ROUTES_LUA`):
        only the newest ``routes_per_session`` members, the others would leave at once."""
        members = [ROUTE + validate_digest(d) for d in digests]
        if prompt is not None:
            members.append(PROMPT + validate_digest(prompt))
        session = validate_id(session, "session id")
        keep = self.routes_per_session
        args = [keep, self.route_ttl_ms, session, self.keys.tenant(tenant), *members[-keep:]]
        return self.keys.session_prefixes(tenant, session), args

    async def match_prefix(self, tenant: str, digests: Sequence[str]) -> tuple[str, str] | None:
        """The first of ``digests`` (pass the longest prefix first) routed to a session that still
        has a record; one round trip (a script) whatever the number of digests."""
        if not digests:
            return None
        keys = [self.keys.prefix_hash(tenant, validate_digest(d)) for d in digests]
        script = self._script("match", _MATCH)
        async with redis_errors():
            found = await script(keys=keys, args=[self.keys.session_prefix(tenant)])
        if not found:
            return None
        return digests[int(found[0]) - 1], text(found[1])

    async def _owned_routes(self, pipe: Any, tenant: str, session: str) -> list[str]:
        """Inside a transaction (immediate mode): WATCH and return the routing keys that still
        name ``session`` — what deleting it must delete besides its set."""
        routes = self.keys.session_prefixes(tenant, session)
        base = self.keys.tenant(tenant)
        route_keys = [f"{base}:{text(m)}" for m in await pipe.zrange(routes, 0, -1)]
        if not route_keys:
            return []
        await pipe.watch(*route_keys)
        targets = await pipe.execute_command("MGET", *route_keys)  # (a cluster pipeline blocks .mget)
        return [k for k, t in zip(route_keys, targets, strict=True) if t is not None and text(t) == session]

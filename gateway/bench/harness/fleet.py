"""The routing bench's synthetic population: sessions indexed as the gateway indexes them, and the
requests that resume some of them.

Session ``i`` belongs to tenant ``i % tenants`` and is named ``s-{i:07d}``; the first ``engines x
slots`` are live in a slot, the rest spilled. Every session has ``turns`` complete turns, whose
digests route its next request (the index keeps its newest ``routes_per_session``). Only the
sessions a request resumes and the live ones need their true digests (the decisions read them);
every other one gets digests of the same length made of its index, so that it takes the bytes in
Redis a real one takes without Python hashing ten million histories.

Loading writes the keys the index's transactions write (`storage.index.keyspace` names them): the
record, the tenant's listing entry, the routes and the session's set of them, and for a live
session the engine's sets and the tenant's live map. The sessions with true digests go through
pipelines; the others are written by a script inside Redis, a tenant's slice at a time (every key
it writes is under the tenant's hash tag, so on a cluster each call is single-slot and the shards
load side by side). Ten million sessions load in minutes where a pipeline per session took hours.
"""

from __future__ import annotations

import asyncio
import bisect
import random
import time
from dataclasses import dataclass, replace
from typing import Any

from storage.index.keyspace import member
from storage.index.prefix_digests import ROUTE
from storage.index.session_index import SessionIndex, SessionRecord, SessionState

# what each synthetic session's system prompt opens with (bench gateway's sessions open with it too)
SYSTEM = (
    "You are a coding agent. You can read files, run tests and edit code. Think step by step, keep "
    "answers short, and call tools with JSON arguments. "
)
LAST_USED = 1_700_000_000.0  # session i was last used at LAST_USED + i
_SESSION_MARK, _USED_MARK, _DIGEST_MARK = "sessionmark", "1234567.0", "digestmark"


@dataclass(frozen=True)
class Fleet:
    """The synthetic population: its size, the sessions with true digests, and the requests."""

    model: str
    tenants: list[str]
    engines: list[str]
    slots: int
    n_sessions: int
    turns: int
    digests: dict[int, list[str]]  # per live or resumed session: the digests finish() would record
    requests: list[list[dict[str, str]]]  # per sampled request: its messages
    request_owner: list[int]  # per sampled request: the index of the session it resumes
    routes_per_session: int  # the newest digests the index keeps per session

    @property
    def n_live(self) -> int:
        return min(self.n_sessions, len(self.engines) * self.slots)

    def session(self, i: int) -> tuple[str, str]:
        """Session ``i``: (tenant, session id)."""
        return self.tenants[i % len(self.tenants)], f"s-{i:07d}"

    def record(self, i: int) -> SessionRecord:
        """Session ``i``'s record as the index would hold it."""
        spilled = self.spilled(*self.session(i), LAST_USED + i)
        if i >= self.n_live:
            return spilled
        engine, slot = self.engines[i // self.slots], i % self.slots
        return replace(spilled, state=SessionState.LIVE, engine=engine, slot=slot)

    def spilled(self, tenant: str, session: str, last_used: float) -> SessionRecord:
        """The record of a spilled session of the fleet."""
        return SessionRecord(
            tenant,
            session,
            SessionState.SPILLED,
            model=self.model,
            tokens=4000,
            generation=1,
            blob_key=f"slotkeeper/{tenant}/{session}/{1:020d}.slot",
            bytes=1 << 26,
            last_used=last_used,
        )

    @property
    def kept(self) -> int:
        """Route digests each session keeps in the index."""
        return min(self.turns, self.routes_per_session)


def history(tenant: str, i: int, turns: int) -> list[dict[str, str]]:
    """Session ``i``'s messages after ``turns`` complete turns."""
    msgs = [{"role": "system", "content": f"You are the coding agent of {tenant}. " + SYSTEM}]
    for j in range(turns):
        msgs.append({"role": "user", "content": f"Session {i}, step {j}: run the tests."})
        msgs.append({"role": "assistant", "content": f"Step {j} of session {i}: 3 passed, 1 failed."})
    return msgs


def build_fleet(
    n_sessions: int,
    *,
    tenants: int,
    engines: int,
    slots: int,
    turns: int,
    routes_per_session: int,
    request_pool: int,
) -> Fleet:
    from gateway.turn.prompt import turn_digests

    model = "qwen35-bench-seed0"
    names = [f"tenant{t}" for t in range(tenants)]
    rng = random.Random(7)
    owners = [rng.randrange(n_sessions) for _ in range(request_pool)]
    n_live = min(n_sessions, engines * slots)

    def tenant_of(i: int) -> str:
        return names[i % len(names)]

    digests = {i: turn_digests(history(tenant_of(i), i, turns), model) for i in {*range(n_live), *owners}}
    requests = [history(tenant_of(i), i, turns) + [{"role": "user", "content": "Next step."}] for i in owners]
    return Fleet(
        model,
        names,
        [f"bench-e{e}" for e in range(engines)],
        slots,
        n_sessions,
        turns,
        digests,
        requests,
        owners,
        routes_per_session,
    )


# KEYS[1]: the tenant's session listing (it routes the call; every key written is in its slot).
# ARGV[1..4]: first session index, how many, the step between them (the tenants' count), the
# length of a digest; ARGV[5]: the record key, ARGV[6]: a route key, ARGV[7]: the session's set of
# routes, ARGV[8]: a route member (templates: \1 stands for the session id, \3 for a digest);
# ARGV[9]: route digests per session; ARGV[10]: how many record fields; then the record's fields and
# values (\1 the session id, \2 its last use), then the indexes to leave out (written elsewhere).
_FILL = """
local first, count, step, dlen = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local record, route, routes, entry = ARGV[5], ARGV[6], ARGV[7], ARGV[8]
local kept, nfields = tonumber(ARGV[9]), tonumber(ARGV[10])
local made = '%0' .. (dlen - 8) .. 'x%08x'  -- a digest: session index, route number (unique in the tenant)
local skip = {}
for j = 11 + 2 * nfields, #ARGV do skip[tonumber(ARGV[j])] = true end
local function put(template, sid, used, digest)
  local s = string.gsub(template, '\\1', sid)
  if used then s = string.gsub(s, '\\2', used) end
  if digest then s = string.gsub(s, '\\3', digest) end
  return s
end
for k = 0, count - 1 do
  local i = first + k * step
  if not skip[i] then
    local sid = string.format('s-%07d', i)  -- (Fleet.session's)
    local used = string.format('%d.0', LAST_USED + i)
    local h = {}
    for f = 0, nfields - 1 do
      h[#h + 1] = ARGV[11 + 2 * f]
      h[#h + 1] = put(ARGV[12 + 2 * f], sid, used)
    end
    redis.call('HSET', put(record, sid), unpack(h))
    redis.call('ZADD', KEYS[1], LAST_USED + i, sid)
    local members = {}
    for n = 0, kept - 1 do
      local d = string.format(made, i, n)
      redis.call('SET', put(route, sid, nil, d), sid)
      members[#members + 1] = n
      members[#members + 1] = put(entry, sid, nil, d)
    end
    if kept > 0 then redis.call('ZADD', put(routes, sid), unpack(members)) end
  end
end
return count
"""


async def load_fleet(redis: Any, fleet: Fleet, batch: int = 500, scripted: int = 2000) -> float:
    """Write every session's keys; returns the seconds taken. The sessions with true digests go
    through pipelines of ``batch``, the others through the script, ``scripted`` per call."""
    keys = SessionIndex(redis).keys
    t0 = time.perf_counter()
    known = sorted(fleet.digests)
    for start in range(0, len(known), batch):
        async with redis.pipeline(transaction=False) as pipe:
            for i in known[start : start + batch]:
                _queue(pipe, keys, fleet, i)
            await pipe.execute()
    fill = redis.register_script(_FILL.replace("LAST_USED", repr(LAST_USED)))
    step = len(fleet.tenants)
    template = _templates(keys, fleet)

    async def tenant(t: int) -> None:
        name, mine = fleet.tenants[t], [i for i in known if i % step == t]
        args = template(name)
        first = t
        while first < fleet.n_sessions:
            count = min(scripted, (fleet.n_sessions - first + step - 1) // step)
            last = first + (count - 1) * step
            skip = mine[bisect.bisect_left(mine, first) : bisect.bisect_right(mine, last)]
            await fill(keys=[keys.sessions(name)], args=[first, count, step, *args, *skip])
            first = last + step

    await asyncio.gather(*(tenant(t) for t in range(step)))
    return time.perf_counter() - t0


def _queue(pipe: Any, keys: Any, fleet: Fleet, i: int) -> None:
    """Session ``i``'s keys, its true digests among them, queued on ``pipe``."""
    rec = fleet.record(i)
    tenant, session = rec.tenant, rec.session
    pipe.hset(keys.session(tenant, session), mapping=rec.to_hash())
    pipe.zadd(keys.sessions(tenant), {session: rec.last_used})
    if rec.engine is not None:
        pipe.sadd(keys.engine_live(rec.engine), member(tenant, session))
        pipe.zadd(keys.engine_idle(rec.engine), {member(tenant, session): rec.last_used})
        pipe.hset(keys.tenant_live(tenant), mapping={session: rec.engine})
    kept = fleet.digests[i][-fleet.routes_per_session :]  # what the index keeps of them
    for d in kept:
        pipe.set(keys.prefix_hash(tenant, d), session)
    if kept:
        pipe.zadd(keys.session_prefixes(tenant, session), {ROUTE + d: n for n, d in enumerate(kept)})


def _templates(keys: Any, fleet: Fleet) -> Any:
    """The script's arguments after the first three, for a tenant: its key templates and a spilled
    session's record, each with the marks the script fills in."""
    dlen = next((len(d[0]) for d in fleet.digests.values() if d), 32)  # a true digest's length

    def marked(text: str) -> str:
        return text.replace(_SESSION_MARK, "\1").replace(_USED_MARK, "\2").replace(_DIGEST_MARK, "\3")

    def for_tenant(tenant: str) -> list[Any]:
        fields = fleet.spilled(tenant, _SESSION_MARK, float(_USED_MARK)).to_hash()
        out: list[Any] = [
            dlen,
            marked(keys.session(tenant, _SESSION_MARK)),
            marked(keys.prefix_hash(tenant, _DIGEST_MARK)),
            marked(keys.session_prefixes(tenant, _SESSION_MARK)),
            marked(ROUTE + _DIGEST_MARK),
            fleet.kept,
            len(fields),
        ]
        for name, value in fields.items():
            out += [name, marked(value)]
        return out

    return for_tenant

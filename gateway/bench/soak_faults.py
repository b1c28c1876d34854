"""`bench soak --faults`: what goes wrong during a soak, at random intervals (seeded).

* ``engine`` — a ready engine process SIGKILLed; then a wait (with a deadline) for the node to bring
  a new process to ready;
* ``redis`` — redis-server SIGKILLed and, after the outage, started again *empty* on the same port
  (what a Redis without persistence does): the gateway must notice the lost index and heal it;
* ``store`` — the link to S3 down for the outage (connections reset and refused; S3 keeps its data);
* ``partition`` — the link to Redis down for the outage (Redis keeps its data).

serve reaches Redis and S3 through relays (gateway.bench.harness.slow_link) so that the last two
can be cut. Right before each fault the honest sessions already saved are noted (`note_durable`):
their state must outlive it. Each fault's window is recorded (`Soak.faults`): a turn whose save a
window overlaps is not counted lost when its newest state is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from dataclasses import dataclass

import httpx

from engine_pool.protocol.node import NodeEngine
from gateway.bench.harness.answers import engine_list
from gateway.bench.harness.servers import RedisProcess, is_engine_process
from gateway.bench.harness.slow_link import SlowLink
from gateway.bench.soak_state import HONEST, Soak

FAULT_KINDS = ("engine", "redis", "store", "partition")


def fault_kinds(text: str) -> tuple[str, ...]:
    """``--faults``: a comma-separated subset of FAULT_KINDS (``all``: every one). Pure."""
    kinds = FAULT_KINDS if text.strip() == "all" else tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in FAULT_KINDS]
    if unknown or not kinds:
        raise ValueError(f"--faults takes {', '.join(FAULT_KINDS)} or all, comma-separated (not {text!r})")
    return tuple(dict.fromkeys(kinds))


@dataclass
class Backends:
    """What the ``redis``, ``store`` and ``partition`` faults act on."""

    redis: RedisProcess
    redis_link: SlowLink  # serve's way to Redis
    store_link: SlowLink  # serve's way to S3


async def list_engines(client: httpx.AsyncClient, soak: Soak) -> list[NodeEngine]:
    r = await client.get(soak.node_url + "/v1/engines", headers={"Authorization": f"Bearer {soak.key}"})
    r.raise_for_status()
    engines = engine_list(r)
    soak.engine_pids |= {e.pid for e in engines if e.pid}
    return engines


async def engines_ready(client: httpx.AsyncClient, soak: Soak, old_pid: int, within_s: float) -> bool:
    """Waits until every engine is ready in a process other than `old_pid` and the gateway is ready."""
    until = time.monotonic() + within_s
    while time.monotonic() < until:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            engines = await list_engines(client, soak)
            if all(e.state == "ready" and e.pid not in (None, old_pid) for e in engines):
                if engines and (await client.get(soak.url + "/ready")).status_code == 200:
                    return True
        await asyncio.sleep(0.5)
    return False


async def note_durable(client: httpx.AsyncClient, soak: Soak) -> None:
    """Record which honest sessions the index shows saved (a durable generation): their state
    outlives any fault from now on, whatever the timing of their turns says."""
    for key in HONEST.values():
        r = await client.get(soak.url + "/v1/sessions", headers={"Authorization": f"Bearer {key}"})
        r.raise_for_status()
        now = time.monotonic()  # the records were read before the answer arrived
        for rec in r.json()["data"]:
            if int(rec.get("generation") or 0) > 0:
                soak.durable.setdefault(str(rec["id"]), now)


async def kill_engine(client: httpx.AsyncClient, soak: Soak, rng: random.Random) -> None:
    """SIGKILL a ready engine; then wait for its replacement to be ready."""
    ready = [e.pid for e in await list_engines(client, soak) if e.state == "ready" and e.pid]
    pid = rng.choice(ready) if ready else 0
    if not pid or not is_engine_process(pid):
        return
    os.kill(pid, signal.SIGKILL)
    soak.kills.append(t0 := time.monotonic())
    print(f"  {soak.at()} SIGKILL engine pid {pid}", flush=True)
    if await engines_ready(client, soak, pid, within_s=120):
        soak.recoveries_s.append(time.monotonic() - t0)
    else:
        soak.not_recovered += 1


async def outage(soak: Soak, kind: str, seconds: float, backends: Backends) -> None:
    """One outage of ``kind`` for ``seconds``; its window is recorded when it is over."""
    t0 = time.monotonic()
    print(f"  {soak.at()} {kind} outage for {seconds:.0f} s", flush=True)
    try:
        if kind == "redis":
            await asyncio.to_thread(backends.redis.kill)
            await asyncio.sleep(seconds)  # deliberate: the outage's length
            await asyncio.to_thread(backends.redis.start)  # back empty
        else:
            link = backends.store_link if kind == "store" else backends.redis_link
            link.down()
            try:
                await asyncio.sleep(seconds)  # deliberate: the outage's length
            finally:
                link.up()
    finally:
        soak.faults.append((kind, t0, time.monotonic()))


async def run_faults(
    client: httpx.AsyncClient, soak: Soak, rng: random.Random, kinds: tuple[str, ...], backends: Backends
) -> None:
    """One fault of a random kind at random intervals (``--fault-min-s``..``--fault-max-s``) until the
    soak's end; outages last ``--outage-min-s``..``--outage-max-s``."""
    args = soak.args
    while True:
        delay = rng.uniform(args.fault_min_s, args.fault_max_s)
        kind = rng.choice(kinds)
        seconds = rng.uniform(args.outage_min_s, args.outage_max_s)
        if delay + (0 if kind == "engine" else seconds) >= soak.left() - 10:
            return
        await asyncio.sleep(delay)  # deliberate pacing
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):  # then none is noted
            await note_durable(client, soak)
        if kind == "engine":
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                await kill_engine(client, soak, rng)
        else:
            await outage(soak, kind, seconds, backends)

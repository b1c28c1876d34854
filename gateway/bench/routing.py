"""`slotkeeper bench routing` (also part 2 of `slotkeeper bench gateway`): the gateway's routing
decision, in process, no servers: 100,000 to 10,000,000 sessions (live in 1,000 engines x 4 slots,
the rest spilled; gateway.bench.harness.fleet) with their message-prefix digests, indexed in the
in-process index, in a real redis-server and in a Redis Cluster of three primaries without replicas
(``--topologies``; of valkey-servers too); the decision per request
(implicit resolve by prefix digests, the record, the pool view, `choose_placement`) timed stage by
stage, one at a time and concurrently, with the Redis commands each stage sends (one primary) and
the Redis memory each indexed session takes (``used_memory`` of the primaries, loaded minus empty,
over the sessions).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from engine_pool.protocol.codec import Wire
from gateway.bench.harness.fleet import Fleet, build_fleet, load_fleet
from gateway.bench.harness.redis_topologies import redis_cluster, rehashing
from gateway.bench.harness.report import pct, table
from gateway.bench.harness.servers import redis_server
from storage.index.prefix_digests import DEFAULT_ROUTES_PER_SESSION

if TYPE_CHECKING:
    from gateway.tenants import Tenant


@dataclass
class Decider:
    """The gateway's decision path, built the way gateway.main builds it."""

    runner: Any
    cluster: Any
    index: Any
    tenants: dict[str, Tenant]
    model: str

    async def stages(self, messages: list[dict[str, str]]) -> tuple[Any, list[float]]:
        """The decision as TurnRunner makes it: resolve by prefix digests, the record, then the
        session's own slot if it is live there (no pool view), else a sampled pool view and
        `choose_placement`."""
        from gateway.turn.slot_choice import Placement, Serve, SessionView, choose_placement

        t = [time.perf_counter()]
        tenant = self.tenants[_tenant_of(messages)]
        from gateway.turn.prompt import Prompt

        prompt = Prompt(messages, self.model, {"messages": messages})
        session, source = await self.runner.resolve(tenant, {}, {"messages": messages}, prompt)
        t.append(time.perf_counter())
        rec = await self.index.find(tenant.name, session)
        t.append(time.perf_counter())
        placement = None
        if (place := rec.place) is not None:
            engine = await self.cluster.engine(place[0])
            if engine is not None:
                placement = Placement(engine.engine, place[1], Serve.LIVE)
        pool_view: list[Any] = []
        if placement is None:
            pool_view, _ = await self.cluster.pool_view(self.model, holder=(tenant.name, session))
        t.append(time.perf_counter())
        if placement is None:
            view = SessionView(tenant.name, session, rec.engine, rec.slot, rec.generation)
            placement = choose_placement(pool_view, self.model, view)
        t.append(time.perf_counter())
        if source != "implicit":
            raise RuntimeError(f"request for {session} was not routed by its prefixes ({source})")
        return placement, [b - a for a, b in zip(t, t[1:], strict=False)]


def _tenant_of(messages: list[dict[str, str]]) -> str:
    return messages[0]["content"].split(" of ", 1)[1].split(".", 1)[0]


async def make_decider(
    redis: Any, fleet: Fleet, workdir: Path, args: argparse.Namespace
) -> tuple[Decider, Callable[[], Awaitable[None]]]:
    from gateway.cluster import Cluster
    from gateway.metrics import Metrics
    from gateway.tenants import Tenant
    from gateway.turn.parts import TurnParts, TurnSettings
    from gateway.turn.runner import TurnRunner
    from storage.blobs.localstore import LocalStore
    from storage.index.engines import EngineRegistry
    from storage.index.locks import SessionLocks
    from storage.index.session_index import SessionIndex

    index, locks, registry = SessionIndex(redis), SessionLocks(redis), EngineRegistry(redis)
    for e in fleet.engines:
        await registry.register(
            e, node="bench", url=f"http://127.0.0.1:1/{e}", model=fleet.model, n_slots=fleet.slots, ttl_s=3600
        )
    http = httpx.AsyncClient()
    store = LocalStore(workdir / "routing-blobs")
    cluster = Cluster(registry, index, (), http, sample=args.placement_sample)
    settings = TurnSettings(lock_ttl_s=60, spill_wait_s=5)
    runner = TurnRunner(TurnParts(cluster, index, locks, store, Metrics(), settings))

    async def close() -> None:
        await http.aclose()
        await store.aclose()

    return Decider(runner, cluster, index, {t: Tenant(t) for t in fleet.tenants}, fleet.model), close


@dataclass
class RoutingResult:
    backend: str
    load_s: float
    stage_us: list[list[float]]  # per stage: microseconds of each sequential decision
    sequential_per_s: float
    concurrent_per_s: float
    commands: list[float] | None  # Redis commands per stage (redis-server only)
    serves: dict[str, int]
    pool_view: list[Any]  # the engines as the decisions saw them (for choose_placement alone)
    bytes_per_session: float | None = None  # Redis used_memory per indexed session (real servers)
    server_us: float | None = None  # redis-server's own time per sequential decision (its commandstats)
    rehashing_per_s: float | None = None  # one at a time while the servers grew their key tables
    settle_s: float | None = None  # how long the servers took to end that after the load


async def _sequential(
    decider: Decider, fleet: Fleet, args: argparse.Namespace
) -> tuple[list[list[float]], float, dict[str, int]]:
    stage_us: list[list[float]] = [[], [], [], []]
    serves: dict[str, int] = {}
    deadline = time.monotonic() + args.routing_time_limit
    t0 = time.perf_counter()
    n = 0
    while n < args.decisions and time.monotonic() < deadline:
        placement, times = await decider.stages(fleet.requests[n % len(fleet.requests)])
        for k, dt in enumerate(times):
            stage_us[k].append(dt * 1e6)
        serves[placement.serve.value] = serves.get(placement.serve.value, 0) + 1
        n += 1
    return stage_us, n / (time.perf_counter() - t0), serves


async def _concurrent(decider: Decider, fleet: Fleet, args: argparse.Namespace) -> float:
    deadline = time.monotonic() + args.routing_time_limit
    count = 0

    async def worker(w: int) -> None:
        nonlocal count
        i = w
        while count < args.decisions and time.monotonic() < deadline:
            await decider.stages(fleet.requests[i % len(fleet.requests)])
            count += 1
            i += args.concurrency

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(args.concurrency)))
    return count / (time.perf_counter() - t0)


async def _commands_per_stage(redis: Any, decider: Decider, fleet: Fleet, n: int = 50) -> list[float]:
    """Redis commands each stage sends (INFO's counter around every stage; INFO counts itself)."""
    from gateway.turn.prompt import Prompt

    async def counter() -> int:
        return int((await redis.info("stats"))["total_commands_processed"])

    totals = [0, 0, 0]
    for i in range(n):
        msgs = fleet.requests[i]
        tenant = decider.tenants[_tenant_of(msgs)]
        c0 = await counter()
        prompt = Prompt(msgs, decider.model, {"messages": msgs})
        session, _ = await decider.runner.resolve(tenant, {}, {"messages": msgs}, prompt)
        c1 = await counter()
        await decider.index.find(tenant.name, session)
        c2 = await counter()
        await decider.cluster.pool_view(decider.model, holder=(tenant.name, session))  # a placement's
        c3 = await counter()
        for k, (a, b) in enumerate([(c0, c1), (c1, c2), (c2, c3)]):
            totals[k] += b - a - 1
    return [t / n for t in totals] + [0.0]


async def measure_backend(
    name: str,
    redis: Any,
    fleet: Fleet,
    args: argparse.Namespace,
    workdir: Path,
    count_commands: bool,
    used_memory: Callable[[], int] | None = None,
    rehashing: Callable[[], bool] | None = None,
) -> RoutingResult:
    """One backend's decisions over ``fleet``. ``rehashing`` (real servers): whether a server is
    still growing its key table after the load; the decisions are measured once while it does, and
    then, as every other figure, once it is done (a steady index, whatever its size)."""
    empty = used_memory() if used_memory is not None else 0
    load_s = await load_fleet(redis, fleet)
    per_session = (used_memory() - empty) / fleet.n_sessions if used_memory is not None else None
    decider, close = await make_decider(redis, fleet, workdir, args)
    try:
        pool_view = await _sanity(decider, fleet)
        rehashing_per_s, settle_s = None, None
        if rehashing is not None:
            t0 = time.perf_counter()
            if await asyncio.to_thread(rehashing):
                rehashing_per_s = (await _sequential(decider, fleet, args))[1]
                await _settled(rehashing)
            settle_s = time.perf_counter() - t0
        if count_commands:
            await redis.config_resetstat()
        stage_us, seq, serves = await _sequential(decider, fleet, args)
        server_us = await _server_us(redis) / len(stage_us[0]) if count_commands else None
        conc = await _concurrent(decider, fleet, args)
        commands = await _commands_per_stage(redis, decider, fleet) if count_commands else None
    finally:
        await close()
    return RoutingResult(
        name,
        load_s,
        stage_us,
        seq,
        conc,
        commands,
        serves,
        pool_view,
        per_session,
        server_us,
        rehashing_per_s,
        settle_s,
    )


async def _settled(rehashing: Callable[[], bool], timeout_s: float = 3600.0) -> None:
    """Wait until no server is growing its key table any more (Redis does it a step per lookup and
    a millisecond per tenth of a second; a 50-million-key table takes minutes). Asking walks the
    whole table inside the server (DEBUG HTSTATS), seconds at that size: it is asked at most a
    tenth of the time."""
    deadline = time.monotonic() + timeout_s
    while True:
        t0 = time.monotonic()
        if not await asyncio.to_thread(rehashing):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the servers still grow their key tables after {timeout_s:.0f} s")
        await asyncio.sleep(max(0.5, 9 * (time.monotonic() - t0)))


async def _server_us(redis: Any) -> float:
    """Microseconds redis-server spent in commands since its stats were reset (but this INFO)."""
    stats = await redis.info("commandstats")
    return float(sum(v["usec"] for k, v in stats.items() if k != "cmdstat_info"))


async def _sanity(decider: Decider, fleet: Fleet) -> list[Any]:
    """The loaded keys read back through the index as the gateway would see them."""
    n_live = fleet.n_live
    sample, decider.cluster.sample = decider.cluster.sample, len(fleet.engines)  # the whole pool, once
    try:
        pool_view, _ = await decider.cluster.pool_view(fleet.model)
    finally:
        decider.cluster.sample = sample
    occupied = sum(1 for e in pool_view for s in e.slots if s.session is not None)
    if len(pool_view) != len(fleet.engines) or occupied != n_live:
        raise RuntimeError(f"the pool view sees {len(pool_view)} engines and {occupied} live sessions")
    tenant, session = fleet.session(fleet.n_sessions - 1)
    if await decider.index.find(tenant, session) is None:
        raise RuntimeError("the index does not find the loaded sessions")
    return pool_view


def pure_choose(fleet: Fleet, pool_view: list[Any], args: argparse.Namespace) -> float:
    from gateway.turn.slot_choice import SessionView, choose_placement

    first = range(min(fleet.n_sessions, args.request_pool))
    views = [SessionView(t, s, None, None, 1) for t, s in map(fleet.session, first)]
    pool_view = pool_view[: args.placement_sample]  # what one placement looks at
    n, deadline = 0, time.monotonic() + min(5.0, args.routing_time_limit)
    t0 = time.perf_counter()
    while n < 200_000 and time.monotonic() < deadline:
        choose_placement(pool_view, fleet.model, views[n % len(views)])
        n += 1
    return n / (time.perf_counter() - t0)


@dataclass(frozen=True)
class BackendReport:
    """One index backend's decisions: rates, per-stage p50s, Redis commands and memory."""

    backend: str
    load_s: float
    decisions_per_s: float
    decisions_per_s_concurrent: float
    redis_commands_per_stage: list[float] | None  # redis-server only
    redis_bytes_per_session: float | None  # real servers only
    redis_server_us_per_decision: float | None  # redis-server only: its own time in the commands
    decisions_per_s_rehashing: float | None  # one at a time right after the load, while a server
    # grew its key table (None: none did); every other figure is from after it
    rehash_wait_s: float | None  # from the load's end until no server did (real servers)
    stage_p50_us: list[float]
    decision_p50_us: float
    decision_p99_us: float
    placements: dict[str, int]  # how the decisions would serve -> count


@dataclass(frozen=True)
class RoutingReport:
    """One population's decisions on every backend, and `choose_placement` alone."""

    sessions: int
    engines: int
    slots: int
    choose_placement_per_s: float
    backends: list[BackendReport]


@dataclass(frozen=True)
class RoutingBenchReport(Wire):
    """What `slotkeeper bench routing --json` writes."""

    bench: str
    routing: list[RoutingReport]


async def _routing_async(args: argparse.Namespace, workdir: Path) -> list[RoutingReport]:
    import redis.asyncio as aioredis

    from storage.index.session_index import in_process_redis
    from storage.index.topology import connect

    topologies = [t for t in str(args.topologies).split(",") if t]
    if unknown := set(topologies) - set(TOPOLOGIES):
        known = ", ".join(TOPOLOGIES)
        raise SystemExit(f"--topologies: unknown {', '.join(sorted(unknown))} (one of {known})")

    reports = []
    for n_sessions in (int(n) for n in str(args.sessions).split(",")):
        t0 = time.perf_counter()
        fleet = build_fleet(
            n_sessions,
            tenants=args.tenants,
            engines=args.engines,
            slots=args.slots_per_engine,
            turns=args.turns,
            routes_per_session=args.routes_per_session,
            request_pool=args.request_pool,
        )
        digests_s = time.perf_counter() - t0
        results = []
        if n_sessions <= 200_000:
            fake = in_process_redis()
            try:
                results.append(await measure_backend("in-process", fake, fleet, args, workdir, False))
            finally:
                await fake.aclose()
                del fake  # frees the in-process keyspace before the next backend
        for name in topologies:
            server = "valkey" if name.startswith("valkey") else "redis"
            if name in ("standalone", "valkey"):
                data = workdir / f"{server}-{n_sessions}"
                data.mkdir(exist_ok=True)
                with redis_server(data, server=server) as port:
                    real = aioredis.from_url(f"redis://127.0.0.1:{port}", decode_responses=True)
                    try:
                        memory = _used_memory_of(port)
                        kind = f"{server}-server"
                        grows = functools.partial(rehashing, port)
                        results.append(
                            await measure_backend(kind, real, fleet, args, workdir, True, memory, grows)
                        )
                    finally:
                        await real.aclose()
            else:  # cluster, valkey-cluster
                with redis_cluster(workdir / f"{name}-{n_sessions}", replicas=0, server=server) as servers:
                    client = connect(servers.url, decode_responses=True)
                    try:
                        results.append(
                            await measure_backend(
                                f"{server}-cluster (3 primaries, no replicas)",
                                client,
                                fleet,
                                args,
                                workdir,
                                False,
                                servers.used_memory,
                                lambda: any(rehashing(p) for p in servers.primary_ports()),
                            )
                        )
                    finally:
                        await client.aclose()
        pure = pure_choose(fleet, results[0].pool_view, args)
        _print_routing(fleet, results, pure, digests_s, args)
        reports.append(_routing_report(fleet, results, pure))
        del fleet
    return reports


def _used_memory_of(port: int) -> Callable[[], int]:
    """``used_memory`` of the redis-server on ``port``, read when called."""
    from gateway.bench.harness.redis_topologies import cli

    def read() -> int:
        line = next(x for x in cli(port, "info", "memory").splitlines() if x.startswith("used_memory:"))
        return int(line.split(":")[1])

    return read


def _routing_report(fleet: Fleet, results: list[RoutingResult], pure: float) -> RoutingReport:
    backends = [
        BackendReport(
            backend=r.backend,
            load_s=r.load_s,
            decisions_per_s=r.sequential_per_s,
            decisions_per_s_concurrent=r.concurrent_per_s,
            redis_commands_per_stage=r.commands,
            redis_bytes_per_session=r.bytes_per_session,
            redis_server_us_per_decision=r.server_us,
            decisions_per_s_rehashing=r.rehashing_per_s,
            rehash_wait_s=r.settle_s,
            stage_p50_us=[pct(us, 50) for us in r.stage_us],
            decision_p50_us=pct([sum(v) for v in zip(*r.stage_us, strict=True)], 50),
            decision_p99_us=pct([sum(v) for v in zip(*r.stage_us, strict=True)], 99),
            placements=r.serves,
        )
        for r in results
    ]
    return RoutingReport(fleet.n_sessions, len(fleet.engines), fleet.slots, pure, backends)


def routing(args: argparse.Namespace, workdir: Path) -> list[RoutingReport]:
    from engine_pool.process import logs

    logs.configure("json", "warning")  # the index logs every registration; keep the table readable
    return asyncio.run(_routing_async(args, workdir))


TOPOLOGIES = ("standalone", "cluster", "valkey", "valkey-cluster")
STAGES = ["resolve (match_prefix)", "index.find", "own slot or sampled pool view", "choose_placement"]


def _bottleneck(r: RoutingResult, n_engines: int) -> str:
    """The stage that takes most of a decision, in words."""
    means = [statistics.fmean(us) for us in r.stage_us]
    k = max(range(len(means)), key=means.__getitem__)
    line = f"{r.backend}: {STAGES[k]} takes {100 * means[k] / sum(means):.0f}% of a decision"
    if r.commands is not None:
        line += (
            f" and sends {r.commands[k]:.0f} of its {sum(r.commands):.0f} Redis commands "
            f"({r.commands[k] / n_engines:.1f} per engine)"
        )
    return line


def _print_routing(
    fleet: Fleet, results: list[RoutingResult], pure: float, digests_s: float, args: argparse.Namespace
) -> None:
    n_live = fleet.n_live
    n_engines = len(fleet.engines)
    print(
        f"\n== 2. routing decisions: {fleet.n_sessions:,} sessions ({n_live} live in {n_engines} "
        f"engines x {fleet.slots} slots, the rest spilled), {len(fleet.tenants)} tenants, "
        f"{fleet.kept} route digests each (those of the {len(fleet.digests):,} live or resumed "
        f"sessions computed in {digests_s:.1f} s) =="
    )
    rows = []
    for r in results:
        cmds = r.commands or [float("nan")] * 4
        total = [sum(v) for v in zip(*r.stage_us, strict=True)]
        for name, us, c in zip(STAGES, r.stage_us, cmds, strict=True):
            share = 100 * statistics.fmean(us) / statistics.fmean(total)
            rows.append(
                [
                    r.backend,
                    name,
                    f"{pct(us, 50):.0f}",
                    f"{pct(us, 99):.0f}",
                    f"{share:.0f}%",
                    "" if math.isnan(c) else f"{c:.1f}",
                ]
            )
        rows.append(
            [
                r.backend,
                "decision (sum)",
                f"{pct(total, 50):.0f}",
                f"{pct(total, 99):.0f}",
                "100%",
                "" if r.commands is None else f"{sum(cmds):.1f}",
            ]
        )
    print(table(["backend", "stage", "p50 us", "p99 us", "share", "redis cmds"], rows))
    for r in results:
        print(_bottleneck(r, n_engines))
    rows = [
        [
            r.backend,
            f"{r.load_s:.1f}",
            f"{len(r.stage_us[0])}",
            f"{r.sequential_per_s:,.0f}",
            f"{r.concurrent_per_s:,.0f}",
            "" if r.bytes_per_session is None else f"{r.bytes_per_session:,.0f}",
            "" if r.server_us is None else f"{r.server_us:,.0f}",
            _rehash_cell(r),
            ",".join(f"{k}:{v}" for k, v in sorted(r.serves.items())),
        ]
        for r in results
    ]
    rows.append(["choose_placement alone", "", "", f"{pure:,.0f}", "", "", "", "", ""])
    print()
    print(
        table(
            [
                "backend",
                "load s",
                "decisions",
                "decisions/s (1 at a time)",
                f"decisions/s ({args.concurrency} concurrent)",
                "redis bytes/session",
                "redis-server us/decision",
                "1 at a time while rehashing (s to end)",
                "placements",
            ],
            rows,
        )
    )


def _rehash_cell(r: RoutingResult) -> str:
    """The decisions/s right after the load while a server grew its key table, and how long it
    took to end: what the table's other figures waited for."""
    if r.settle_s is None:
        return ""
    if r.rehashing_per_s is None:
        return "(not rehashing)"
    return f"{r.rehashing_per_s:,.0f} ({r.settle_s:.0f} s)"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The routing options, in a group of their own (this bench's and `bench gateway`'s)."""
    g = ap.add_argument_group("2. routing")
    g.add_argument(
        "--sessions",
        default="100000,1000000",
        help="indexed sessions, comma-separated (in-process index: up to 200,000)",
    )
    g.add_argument(
        "--topologies",
        default="standalone,cluster",
        help="Redis topologies, comma-separated: standalone (one redis-server), cluster (3 primaries, "
        "no replicas), valkey, valkey-cluster (the same of valkey-servers)",
    )
    g.add_argument("--tenants", type=int, default=10)
    g.add_argument("--engines", type=int, default=1000, help="simulated engines in the registry")
    g.add_argument("--placement-sample", type=int, default=8, help="engines one placement looks at")
    g.add_argument("--slots-per-engine", type=int, default=4)
    g.add_argument("--turns", type=int, default=3, help="complete turns (prefix digests) per session")
    g.add_argument(
        "--routes-per-session",
        type=int,
        default=DEFAULT_ROUTES_PER_SESSION,
        help=f"route digests the index keeps per session, its newest ({DEFAULT_ROUTES_PER_SESSION})",
    )
    g.add_argument("--decisions", type=int, default=2000, help="decisions per measurement, at most")
    g.add_argument("--concurrency", type=int, default=16)
    g.add_argument("--request-pool", type=int, default=2000, help="distinct requests cycled through")
    g.add_argument("--routing-time-limit", type=float, default=20.0, help="seconds per measurement")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="slotkeeper bench routing", description=__doc__)
    ap.add_argument("--workdir", help="keep the redis-server data here (default: a temporary directory)")
    ap.add_argument("--json", help="also write the results here as JSON")
    add_arguments(ap)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        workdir = Path(args.workdir or tmp).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        report = RoutingBenchReport("routing", routing(args, workdir))
        if args.json:
            Path(args.json).write_text(json.dumps(report.to_json(), indent=2))
    return 0

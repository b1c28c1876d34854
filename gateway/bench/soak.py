"""`slotkeeper bench soak`: honest load, a hostile client and faults at once, for `--duration-s`
(10 minutes by default), everything on loopback:

* redis-server, moto's S3 server (bucket `slots`) and `slotkeeper serve --slots 8 --ctx 2048` on the
  tiny qwen35, with SLOTKEEPER_INTERNAL_KEY set so that the benchmark can list the node's engines;
* honest load — 64 sessions of two after-turn tenants (32 each, X-Session-Id), growing multi-turn
  chats (max_tokens 8, temperature 0) sent by `--workers` workers, each taking a random idle session
  and sending its next turn; 429/503 are retried after Retry-After. After `--max-turns` turns a
  session is DELETEd and continues under a fresh id, so that its history fits the context;
* faults (soak_faults.py) at random intervals (`--fault-min-s`..`--fault-max-s`, seeded), of the
  `--faults` kinds: `engine` (a ready engine SIGKILLed, the default), `redis` (SIGKILLed, back
  empty), `store` (the S3 link down), `partition` (the Redis link down); outages last
  `--outage-min-s`..`--outage-max-s`;
* a hostile tenant (soak_hostile.py) sending the inputs of KINDS in a loop, each judged against what
  is expected of it: a 5xx other than 503, or anything but the expected 4xx, is flagged;
* at the end, engines ready again: GET /v1/sessions/{id} and one more turn for every honest session.

A session is *lost* when a turn (during the soak or the last one) is served `X-Slotkeeper-Cache:
cold`, or its record is gone, although its state was durable: the index showed a saved generation
of it (the faults task lists the honest sessions right before each fault), or it had a completed
turn whose write-behind save no fault could have cut short: none from 1 s before the answer until
that save was certainly over — once a later turn of the session was answered `restored` or `cold`
(its placement waits for the saves still running) or `--save-grace-s` (the gateway's 30 s wait for
a save) had passed. Sending the next turn ends nothing: one served `live` in its slot runs beside
the save, which a fault can still cut short then.
Such a session served `live` or `restored` with `usage.prompt_tokens_details.cached_tokens == 0`
kept its state but reused none of it: *re-prefilled*, counted apart (it costs what a cold turn does).

Goals, each 0 (exit code 0 when all hold, else 1): honest 5xx other than 503, honest 4xx other than
429, honest transport errors, sessions lost, sessions re-prefilled, unexpected hostile answers,
`slotkeeper_gateway_requests` series over a bound after the random 404 paths, killed engines not
ready again. Also reported: requests served, 429/503 counts, p50/p99 latency per honest tenant,
engine restarts (the node's count) and SIGKILLs sent, hostile statuses per kind; `--json OUT`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from engine_pool.protocol.codec import Wire
from engine_pool.protocol.node import NodeEngine
from gateway.bench.harness.answers import chat_answer, engine_list
from gateway.bench.harness.report import pct, table
from gateway.bench.harness.servers import (
    AWS_ENV,
    PACKAGE_ROOT,
    MotoProcess,
    RedisProcess,
    free_port,
    http_ok,
    kill_engines,
    wait_until,
)
from gateway.bench.harness.slow_link import SlowLink
from gateway.bench.soak_faults import Backends, engines_ready, fault_kinds, list_engines, run_faults
from gateway.bench.soak_hostile import Hostile
from gateway.bench.soak_state import (
    HEADER_TIMEOUT_S,
    HONEST,
    HOSTILE_INFLIGHT,
    HOSTILE_KEY,
    HOSTILE_RPM,
    MAX_SERIES,
    WORDS,
    Soak,
    retry_after,
)
from native.model_gen import cached_model

TENANTS_TOML = f"""
[tenants.alpha]
keys = ["{HONEST["alpha"]}"]
durability = "after-turn"
quotas = {{ sessions = 10000, requests_per_minute = 1000000, inflight = 32 }}
[tenants.beta]
keys = ["{HONEST["beta"]}"]
durability = "after-turn"
quotas = {{ sessions = 10000, requests_per_minute = 1000000, inflight = 32 }}
[tenants.mallory]
keys = ["{HOSTILE_KEY}"]
durability = "on-evict"
[tenants.mallory.quotas]
sessions = 1000
requests_per_minute = {HOSTILE_RPM}
inflight = {HOSTILE_INFLIGHT}
live_slots = 3
"""


# ------------------------------------------------------------------------- slotkeeper serve process
@dataclass
class Serve:
    url: str
    node_url: str
    key: str
    proc: subprocess.Popen[bytes]
    engine_pids: set[int] = field(default_factory=set)

    def engines(self) -> list[NodeEngine]:
        r = httpx.get(
            self.node_url + "/v1/engines", headers={"Authorization": f"Bearer {self.key}"}, timeout=5
        )
        r.raise_for_status()
        engines = engine_list(r)
        self.engine_pids |= {e.pid for e in engines if e.pid}
        return engines

    def close(self, graceful: bool) -> None:
        """SIGTERM (the node drains and stops its engines) unless interrupted, then SIGKILL of serve's
        group and of every engine's group (each engine leads its own, beyond serve's)."""
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            self.engines()
        if graceful and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(90)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        kill_engines(self.engine_pids)


@contextlib.contextmanager
def serving(workdir: Path, flags: list[str], key: str, done: list[bool]) -> Iterator[Serve]:
    """`slotkeeper serve` until ready; stopped gracefully on the way out once `done` holds True."""
    port, node_port = free_port(), free_port()
    cmd = [
        *(sys.executable, "-m", "gateway.cli", "serve"),
        *("--port", str(port)),
        *("--node-port", str(node_port)),
        *("--header-timeout-s", str(HEADER_TIMEOUT_S)),
        *flags,
    ]
    env = {**os.environ, **AWS_ENV, "SLOTKEEPER_INTERNAL_KEY": key}
    log = workdir / "serve.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            cmd, cwd=PACKAGE_ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    serve = Serve(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{node_port}", key, proc)
    try:
        try:
            wait_until(lambda: http_ok(serve.url + "/ready"), proc, "slotkeeper serve", timeout=180)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n{log.read_text(errors='replace')[-3000:]}") from None
        yield serve
    finally:
        serve.close(graceful=any(done))


# ------------------------------------------------------------------------------------ honest load
@dataclass
class Session:
    tenant: str
    name: str
    rng: random.Random
    history: list[dict[str, str]]
    epoch: int = 0
    done_at: list[float] = field(default_factory=list)  # answer times of this id's completed turns
    waited: list[bool] = field(default_factory=list)  # and whether each was placed anew (not live, no fork)
    busy: bool = False

    @property
    def id(self) -> str:
        return f"{self.name}-e{self.epoch}"

    def protected(self, soak: Soak, before: float) -> bool:
        """Its state was durable before `before`: a listing before a SIGKILL showed it saved, or it
        has a completed turn answered before `before` whose write-behind save no SIGKILL could have
        cut short: none from 1 s before the answer until the save was certainly over. That is the
        save grace after the answer, or sooner the answer of a later turn placed anew (restored or
        cold): the gateway places such a turn only once the saves of the session's earlier turns are
        over. A next turn served live in its slot does not wait for them: it bounds nothing."""
        if soak.durable.get(self.id, math.inf) < before:
            return True
        grace = soak.args.save_grace_s
        for i, t in enumerate(self.done_at):
            if t >= before:
                break
            over = next(
                (a for a, w in zip(self.done_at[i + 1 :], self.waited[i + 1 :], strict=True) if w), math.inf
            )
            if soak.kill_free(t - 1.0, min(over, t + grace)):
                return True
        return False


# An agent's system prompt is long (rules, tool descriptions): a hybrid model reuses a prefix only
# from a checkpoint, and the engine takes none closer than --checkpoint-min-step (64) tokens apart,
# so toy prompts of a few dozen tokens would be re-prefilled by design, not by fault.
AGENT_RULES = (
    "Work in small steps. Read the failing test first, then the code it exercises. Run the tests "
    "after every change and report the command and its result. Never edit files outside the "
    "repository. Prefer the smallest change that makes the test pass, and explain why it is right. "
)


def make_sessions(seed: int) -> list[Session]:
    return [
        Session(
            tenant,
            f"{tenant}-s{i:02d}",
            random.Random(f"{seed}-{tenant}-{i}"),
            [
                {
                    "role": "system",
                    "content": f"You are the build agent of {tenant}, session {i}. " + AGENT_RULES,
                }
            ],
        )
        for tenant in HONEST
        for i in range(32)
    ]


async def honest_turn(client: httpx.AsyncClient, soak: Soak, s: Session, final: bool = False) -> str:
    """One turn of `s`, 429/503 retried after Retry-After; on a 200 the history grows. Returns how it
    was served (live|restored|cold) or the status it ended with."""
    h = soak.honest
    user = {"role": "user", "content": f"Step {len(s.done_at) + 1}: " + " ".join(s.rng.sample(WORDS, 6))}
    body = {"model": soak.model, "messages": [*s.history, user], "max_tokens": 8, "temperature": 0}
    headers = {"Authorization": f"Bearer {HONEST[s.tenant]}", "X-Session-Id": s.id}
    sent = time.monotonic()
    until = sent + 180 if final else soak.deadline
    for _ in range(60):
        t0 = time.perf_counter()
        try:
            r = await client.post(soak.url + "/v1/chat/completions", json=body, headers=headers)
        except httpx.HTTPError as exc:
            h.transport += 1
            h.sample(type(exc).__name__, f"{soak.at()} {s.id}: {type(exc).__name__}: {exc}")
            return type(exc).__name__
        ms = (time.perf_counter() - t0) * 1000
        if r.status_code in (429, 503):
            h.throttled[r.status_code] += 1
            wait = retry_after(r)
            h.no_retry_after += wait is None
            if time.monotonic() + (wait or 1.0) > until:
                return str(r.status_code)  # the soak ended while waiting: not a failure
            await asyncio.sleep(min(wait or 1.0, 10.0))
            continue
        if r.status_code != 200:
            h.other[r.status_code] += 1
            h.sample(r.status_code, f"{soak.at()} {s.id}: HTTP {r.status_code}: {r.text}")
            return str(r.status_code)
        answer = chat_answer(r.json())
        cache = r.headers.get("x-slotkeeper-cache", "-")
        cached = answer.cached_tokens  # None when missing: nothing to judge reuse by
        h.served[s.tenant] += 1
        h.caches[cache] += 1
        h.latency_ms.setdefault(s.tenant, []).append(ms)
        h.turn_ms.append((time.monotonic() - sent) * 1000)
        forked = r.headers.get("x-session-id") != s.id
        h.forked += forked
        if (cache == "cold" or cached == 0) and s.protected(soak, sent):
            why = f"{soak.at()} {'final' if final else 'soak'} turn served {cache}, cached_tokens {cached}, "
            (h.lost if cache == "cold" else h.reprefilled)[s.id] = f"{why}after {len(s.done_at)} turns"
        s.history += [user, {"role": "assistant", "content": answer.content}]
        s.done_at.append(time.monotonic())
        s.waited.append(cache in ("restored", "cold") and not forked)
        return cache
    h.sample("gave up", f"{soak.at()} {s.id}: still 429/503 after 60 tries")
    return "gave up"


async def roll_over(client: httpx.AsyncClient, soak: Soak, s: Session) -> None:
    """DELETE the session and continue under the next epoch's id (a failed DELETE is only counted:
    the session is idle, its last save at most waited for)."""
    auth = {"Authorization": f"Bearer {HONEST[s.tenant]}"}
    try:
        r = await client.delete(f"{soak.url}/v1/sessions/{s.id}", headers=auth)
        soak.honest.deletes[r.status_code] += 1
    except httpx.HTTPError as exc:
        soak.honest.transport += 1
        soak.honest.sample(type(exc).__name__, f"{soak.at()} DELETE {s.id}: {type(exc).__name__}: {exc}")
    s.epoch += 1
    s.history, s.done_at, s.waited = s.history[:1], [], []


async def honest_worker(client: httpx.AsyncClient, soak: Soak, sessions: list[Session], seed: int) -> None:
    rng = random.Random(seed)
    while soak.left() > 0:
        s = rng.choice([x for x in sessions if not x.busy])  # one turn of a session at a time
        s.busy = True
        try:
            if len(s.done_at) >= soak.args.max_turns:
                await roll_over(client, soak, s)
            await honest_turn(client, soak, s)
        finally:
            s.busy = False


# ---------------------------------------------------------------------------------------- the report
@dataclass(frozen=True)
class Latency:
    n: int
    p50: float
    p99: float


@dataclass(frozen=True)
class HonestReport:
    """The honest tenants' requests: statuses (a Counter's keys: status codes), latencies per
    tenant (and "all honest"), how they were served, samples of what went wrong, and the sessions
    lost or re-prefilled (id -> why)."""

    served: int
    status_429: int
    status_503: int
    throttled_without_retry_after: int
    other_statuses: dict[int, int]
    latency_ms: dict[str, Latency]
    turn_p99_ms_with_retries: float
    served_as: dict[str, int]
    forked: int
    rollover_deletes: dict[int, int]
    samples: list[str]
    lost: dict[str, str]
    reprefilled: dict[str, str]


@dataclass(frozen=True)
class FinalTurn:
    """After the soak: engines ready again, the sessions' records by state, their last turn served as."""

    engines_ready: bool
    records: dict[str, int]
    served: dict[str, int]


@dataclass(frozen=True)
class Outages:
    n: int
    seconds: float


@dataclass(frozen=True)
class EngineFaults:
    sigkills_sent: int
    restarts_reported: int  # by the node
    recovery_s: list[float]


@dataclass(frozen=True)
class KindReport:
    """One hostile input: what is expected, the statuses seen, the unexpected answers (samples)."""

    expect: str
    statuses: dict[str, int]
    throttled_then_retried: int
    p99_ms: float
    unexpected: list[str]


@dataclass(frozen=True)
class HostileReport:
    rounds: int
    kinds: dict[str, KindReport]


@dataclass(frozen=True)
class SoakReport(Wire):
    """What `--json` writes (and `print_report` prints); `goals`: name -> count, each 0 to pass."""

    duration_s: float
    honest: HonestReport
    final_turn: FinalTurn
    faults: dict[str, Outages]  # per outage kind
    engines: EngineFaults
    hostile: HostileReport
    gateway_request_series: int
    goals: dict[str, int]
    ok: bool


# ---------------------------------------------------------------------------------------- the soak
async def verify(client: httpx.AsyncClient, soak: Soak, sessions: list[Session]) -> FinalTurn:
    """Engines ready, then one more turn for every honest session that has completed turns."""
    ready = await engines_ready(client, soak, old_pid=-1, within_s=180)
    records: Counter[str] = Counter()
    served: Counter[str] = Counter()
    gate = asyncio.Semaphore(8)

    async def one(s: Session) -> None:
        async with gate:
            auth = {"Authorization": f"Bearer {HONEST[s.tenant]}"}
            try:
                r = await client.get(f"{soak.url}/v1/sessions/{s.id}", headers=auth)
            except httpx.HTTPError as exc:
                soak.honest.transport += 1
                soak.honest.sample(type(exc).__name__, f"{soak.at()} GET {s.id}: {type(exc).__name__}: {exc}")
                return
            records[str(r.json().get("state")) if r.status_code == 200 else str(r.status_code)] += 1
            if r.status_code == 404 and s.protected(soak, time.monotonic()):
                soak.honest.lost.setdefault(s.id, f"its record is gone (404) after {len(s.done_at)} turns")
            served[await honest_turn(client, soak, s, final=True)] += 1

    await asyncio.gather(*(one(s) for s in sessions if s.done_at))
    return FinalTurn(ready, dict(records), dict(served))


async def soak_run(
    args: argparse.Namespace, serve: Serve, engine: NodeEngine, backends: Backends
) -> SoakReport:
    deadline = time.monotonic() + args.duration_s
    soak = Soak(args, serve.url, serve.node_url, engine.model, engine.id, serve.key, deadline)
    sessions = make_sessions(args.seed)
    # Idle connections are dropped before the gateway's keep-alive timeout (5 s) can close them under
    # a request in flight: a transport error then is the gateway's, not the keep-alive race's.
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=32, keepalive_expiry=2.0)
    async with (
        httpx.AsyncClient(timeout=120, limits=limits) as honest,
        httpx.AsyncClient(timeout=60, limits=limits) as other,
    ):
        hostile = Hostile(soak, other, random.Random(args.seed + 1))
        tasks = [
            asyncio.create_task(honest_worker(honest, soak, sessions, args.seed * 100 + w))
            for w in range(args.workers)
        ]
        tasks += [
            asyncio.create_task(
                run_faults(other, soak, random.Random(args.seed + 2), args.fault_kinds, backends)
            ),
            asyncio.create_task(hostile.run()),
            asyncio.create_task(hostile.trickle()),
        ]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            serve.engine_pids |= soak.engine_pids
        soak_s = args.duration_s - soak.left()
        final = await verify(honest, soak, sessions)
        text = (await other.get(serve.url + "/metrics")).text
        series = sum(ln.startswith("slotkeeper_gateway_requests_total{") for ln in text.splitlines())
        leak = "h404-" in text  # a random path became a label value
        restarts = sum(e.restarts for e in await list_engines(other, soak))
    h = soak.honest
    everyone = [x for v in h.latency_ms.values() for x in v]
    goals = {
        "honest 5xx other than 503": sum(n for s, n in h.other.items() if s >= 500 and s != 503),
        "honest 4xx other than 429": sum(n for s, n in h.other.items() if s < 500),
        "honest transport errors": h.transport,
        "sessions lost beyond the turn in flight": len(h.lost),
        "sessions re-prefilled (live/restored, cached_tokens 0)": len(h.reprefilled),
        "hostile answers unexpected": sum(k.n_unexpected for k in soak.kinds.values()),
        f"request series over {MAX_SERIES}, or a 404 path as label": int(series > MAX_SERIES or leak),
        "engines not ready again within 120 s": soak.not_recovered + (not final.engines_ready),
    }
    kinds = {
        n: KindReport(k.expect, dict(k.statuses), k.throttled, pct(k.ms, 99), k.unexpected)
        for n, k in soak.kinds.items()
    }
    latency = {
        t: Latency(len(v), pct(v, 50), pct(v, 99))
        for t, v in [*sorted(h.latency_ms.items()), ("all honest", everyone)]
    }
    honest_report = HonestReport(
        served=sum(h.served.values()),
        status_429=h.throttled[429],
        status_503=h.throttled[503],
        throttled_without_retry_after=h.no_retry_after,
        other_statuses=dict(h.other),
        latency_ms=latency,
        turn_p99_ms_with_retries=pct(h.turn_ms, 99),
        served_as=dict(h.caches),
        forked=h.forked,
        rollover_deletes=dict(h.deletes),
        samples=h.samples,
        lost=h.lost,
        reprefilled=h.reprefilled,
    )
    outages = {
        kind: Outages(
            sum(1 for k, _, _ in soak.faults if k == kind),
            round(sum(t1 - t0 for k, t0, t1 in soak.faults if k == kind), 1),
        )
        for kind in args.fault_kinds
        if kind != "engine"
    }
    engines = EngineFaults(len(soak.kills), restarts, [round(x, 1) for x in soak.recoveries_s])
    return SoakReport(
        duration_s=round(soak_s, 1),
        honest=honest_report,
        final_turn=final,
        faults=outages,
        engines=engines,
        hostile=HostileReport(hostile.round, kinds),
        gateway_request_series=series,
        goals=goals,
        ok=not any(goals.values()),
    )


def print_report(r: SoakReport) -> None:
    h, e, f = r.honest, r.engines, r.final_turn
    print(
        f"\n== soak: {r.duration_s} s, 64 honest sessions of 2 tenants on 8 slots, a hostile tenant, "
        f"{e.sigkills_sent} engine SIGKILLs =="
    )
    outages = ", ".join(f"{k}: {v.n} ({v.seconds:.0f} s)" for k, v in r.faults.items())
    print(f"outages: {outages or 'none'}")
    rows = [[t, str(v.n), f"{v.p50:.0f}", f"{v.p99:.0f}"] for t, v in h.latency_ms.items()]
    print(table(["honest tenant", "served (200)", "p50 ms", "p99 ms"], rows))
    print(
        f"429: {h.status_429}, 503: {h.status_503} (retried after Retry-After; "
        f"{h.throttled_without_retry_after} had none); other statuses: {h.other_statuses or 'none'}; "
        f"turn p99 with retries {h.turn_p99_ms_with_retries:.0f} ms"
    )
    print(f"served as {h.served_as}, forked {h.forked}, rollover DELETEs {h.rollover_deletes}")
    print(
        f"final turn: records {f.records}, served {f.served}; sessions lost: {len(h.lost)}, "
        f"re-prefilled: {len(h.reprefilled)}"
    )
    print(
        f"engines: {e.sigkills_sent} SIGKILLs, {e.restarts_reported} restarts reported by the node, "
        f"ready again after {e.recovery_s} s"
    )
    lost = [f"lost {sid}: {why}" for sid, why in h.lost.items()]
    lost += [f"re-prefilled {sid}: {why}" for sid, why in h.reprefilled.items()]
    for line in h.samples + lost[:12]:
        print(f"  ! {line}")
    print(f"\n-- hostile tenant: {r.hostile.rounds} rounds --")
    kinds = r.hostile.kinds.items()
    rows = [
        [
            n,
            k.expect,
            ", ".join(f"{s}:{c}" for s, c in sorted(k.statuses.items())) or "-",
            str(k.throttled_then_retried),
            f"{k.p99_ms:.0f}",
        ]
        for n, k in kinds
    ]
    print(table(["input", "expected", "statuses", "429/503 waited", "p99 ms"], rows))
    for name, k in kinds:
        for sample in k.unexpected:
            print(f"  ! {name}: {sample}")
    print(f"gateway request series after the 404 paths: {r.gateway_request_series}\n")
    print(table(["goal", "value (0)"], [[g, str(v)] for g, v in r.goals.items()]))
    print("PASS" if r.ok else "FAIL")


# ========================================================================================= command
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="slotkeeper bench soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--workers", type=int, default=8, help="concurrent honest workers (at most 64)")
    ap.add_argument("--max-turns", type=int, default=12, help="turns before a session rolls over")
    ap.add_argument(
        "--faults",
        default="engine",
        help="what goes wrong, comma-separated: engine, redis, store, partition, or all (engine)",
    )
    ap.add_argument("--fault-min-s", "--kill-min-s", type=float, default=20.0, help="shortest pause, faults")
    ap.add_argument("--fault-max-s", "--kill-max-s", type=float, default=60.0, help="longest pause, faults")
    ap.add_argument("--outage-min-s", type=float, default=5.0, help="shortest redis/store/partition outage")
    ap.add_argument("--outage-max-s", type=float, default=20.0, help="longest redis/store/partition outage")
    ap.add_argument("--save-grace-s", type=float, default=30.0, help="longest write-behind save")
    ap.add_argument("--model", help="GGUF (default: the generated tiny qwen35)")
    ap.add_argument("--models-dir", default=os.path.join(".bench", "models"))
    ap.add_argument("--workdir", help="keep logs and data here (default: a temporary directory)")
    ap.add_argument("--log-level", default="info", help="serve's log level")
    return ap


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        args.fault_kinds = fault_kinds(args.faults)
    except ValueError as exc:
        parser.error(str(exc))
    args.workers = max(1, min(args.workers, 64))
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the CLI's logging says every request
    model = os.path.abspath(args.model or cached_model(args.models_dir, "qwen35", size="tiny"))
    done: list[bool] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        workdir = Path(args.workdir or tmp).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "tenants.toml").write_text(TENANTS_TOML)
        moto, redis = MotoProcess(workdir), RedisProcess(workdir)
        moto.start()
        redis.start()
        # serve reaches both through relays, which the store and partition faults take down.
        redis_link = SlowLink(("127.0.0.1", 0), ("127.0.0.1", redis.port))
        store_link = SlowLink(("127.0.0.1", 0), ("127.0.0.1", moto.port))
        try:
            flags = [
                *("--model", model),
                *("--slots", "8"),
                *("--ctx", "2048"),
                *("--log-level", args.log_level),
                *("--tenants", str(workdir / "tenants.toml")),
                *("--data-dir", str(workdir / "data")),
                *("--redis-url", f"redis://127.0.0.1:{redis_link.port}/0"),
                *("--s3-endpoint", f"http://127.0.0.1:{store_link.port}"),
                *("--s3-bucket", "slots"),
            ]
            backends = Backends(redis, redis_link, store_link)
            with serving(workdir, flags, f"soak-{secrets.token_hex(16)}", done) as serve:
                result = asyncio.run(soak_run(args, serve, serve.engines()[0], backends))
                done.append(True)
        finally:
            redis_link.close()
            store_link.close()
            redis.kill()
            moto.kill()
        print_report(result)
        where = workdir if args.workdir else "a temporary directory, removed"
        print(f"(wall {time.perf_counter() - t0:.0f} s; logs in {where})")
    if args.json:
        plain = json.loads(
            json.dumps(result.to_json(), default=str), parse_constant=lambda _: None
        )  # NaN -> null
        Path(args.json).write_text(json.dumps(plain, indent=2) + "\n")
    return 0 if result.ok else 1

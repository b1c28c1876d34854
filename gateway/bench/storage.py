"""``slotkeeper bench storage``: storage/ against raw transfers and against a full save per turn.

Suites (``--suite``, default ``all``):

* ``transfer`` — one v1 slot file through the blob store against a raw copy (below);
* ``session`` — an agent session of ``--turns`` turns through ``slotkeeper serve`` (chunked store):
  bytes each turn writes and what the store holds after it, against a full save per turn;
* ``restore`` — the session's newest generation fetched from its chunks (parallel, verified,
  assembled) against a raw read of the same number of bytes (one object / one file copy);
* ``ttft`` — time to first token of a turn restored from the store after a restart (spill cache
  off, so the chunks come from the store) against the next, live, turn.

Transfer:

Uploads and downloads one slot file (512 MiB by default) through the S3 store (multipart,
parallel parts, CRC-32 per part and of the whole object, conditional write, verifying head,
temp-file-then-rename download) and through raw boto3 ``upload_file``/``download_file`` with the
same part size and concurrency on the same client configuration; for the local store, against
``shutil.copyfile``. Prints MB/s and the ratio ours/raw (target >= 0.7).

Servers: ``--backend moto`` or ``seaweedfs`` starts one on a free loopback port for the run;
``--backend endpoint --endpoint URL --bucket B`` uses an existing one; ``--backend local``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import os
import random
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from engine_pool.protocol.codec import Wire, decode
from gateway.bench.gateway import stream_turn
from gateway.bench.harness.answers import chat_answer
from gateway.bench.harness.serve import Serve, start_serve
from gateway.bench.harness.served import Manifest, ServedStore
from gateway.bench.harness.servers import eventually

if TYPE_CHECKING:
    from storage.blobs.blobstore import BlobStore
    from storage.ids import SlotRef

MiB = 1 << 20
TARGET = 0.7


@dataclass(frozen=True)
class Transfer:
    """One slot file through the store and raw: MB/s of each (`ours_up`, `raw_down`, ...) and the
    ratios ours/raw (`upload`, `download`)."""

    bytes: int
    part_size_mib: int
    concurrency: int
    fsync: bool
    mb_per_s: dict[str, float]
    ratio: dict[str, float]
    target: float


@dataclass(frozen=True)
class TurnRow:
    """A session turn: its prompt tokens, a full save's bytes, the bytes written after it (the
    gateway's metric) and what the store holds then."""

    turn: int
    tokens: int
    full: int
    written: float
    stored: int


@dataclass(frozen=True)
class SessionReport:
    turns: list[TurnRow]
    written_total: float
    full_save_per_turn_total: int
    median_written_over_full: float
    max_written_over_full: float
    max_stored_over_full: float


@dataclass(frozen=True)
class RestoreTimes:
    """Seconds (the best of the repeats): the newest generation from its chunks, a raw read of as
    many bytes; and each pair's raw/ours, sorted."""

    bytes: int
    ours_s: float
    raw_s: float
    pair_ratios: list[float]


@dataclass(frozen=True)
class TtftTurn:
    ttft_ms: float
    cache: str
    prompt_n: int | None  # None: the stream carried no timings


@dataclass(frozen=True)
class TtftReport:
    restored: TtftTurn
    live: TtftTurn
    ratio: float  # restored / live


@dataclass(frozen=True)
class StorageReport(Wire):
    """What `--json` prints: the suites that ran (the others absent)."""

    sparse = True
    backend: str
    transfer: Transfer | None = None
    session: SessionReport | None = None
    restore: RestoreTimes | None = None
    ttft: TtftReport | None = None


def write_slot_file(path: Path, size: int) -> None:
    """A valid v1 slot file of about ``size`` bytes (random state, no checkpoints)."""
    n_tokens = 1024
    head = struct.pack("<III", 0x67677371, 3, n_tokens) + struct.pack(f"<{n_tokens}i", *range(n_tokens))
    meta = json.dumps(
        {"format": 1, "n_tokens": n_tokens, "model": {"fingerprint": "be" * 32, "arch": "bench"}}
    )
    skmd = struct.pack("<III", 0x444D4B53, 1, 1) + struct.pack("<IIQ", 1, 0, len(meta)) + meta.encode()
    state = max(0, size - len(head) - len(skmd) - 64)
    rng = random.Random(0)
    with open(path, "wb") as f:
        f.write(head)
        crc = zlib.crc32(head)
        left = state
        while left:
            chunk = rng.randbytes(min(left, 8 * MiB))
            f.write(chunk)
            crc = zlib.crc32(chunk, crc)
            left -= len(chunk)
        f.write(skmd)
        crc = zlib.crc32(skmd, crc)
        base = len(head) + state
        trailer = struct.pack("<8sHHIQQQQQI", b"SLOTKEEP", 1, 0, 0, base, 0, 0, base, len(skmd), crc)
        f.write(trailer + struct.pack("<I", zlib.crc32(trailer)))


def _free_port(plus: int = 0) -> int:
    for _ in range(200):
        port = random.randint(20000, 45000)
        try:
            for p in (port, port + plus) if plus else (port,):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port")


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1):  # noqa: S310 - loopback
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} not ready")


@contextmanager
def server(backend: str, workdir: Path) -> Iterator[str]:
    """Start moto (ThreadedMotoServer in a child process) or ``weed mini``; yield the endpoint."""
    if backend == "moto":
        port = _free_port()
        code = (
            "import sys,time\nfrom moto.server import ThreadedMotoServer\n"
            "ThreadedMotoServer(ip_address='127.0.0.1', port=int(sys.argv[1]), verbose=False).start()\n"
            "time.sleep(10**9)\n"
        )
        cmd = [sys.executable, "-c", code, str(port)]
        probe = f"http://127.0.0.1:{port}/moto-api/"
        sockets = []
    else:
        port = _free_port(10000)
        p = {n: _free_port(10000) for n in ("master", "volume", "filer", "admin")}
        (workdir / "weed").mkdir()
        cmd = [
            "weed",
            "mini",
            f"-dir={workdir / 'weed'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            f"-master.port={p['master']}",
            f"-volume.port={p['volume']}",
            f"-filer.port={p['filer']}",
            f"-s3.port={port}",
            f"-admin.port={p['admin']}",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.localSocket={workdir}/s3.sock",
            f"-filer.localSocket={workdir}/filer.sock",
        ]
        sockets = [
            f"/tmp/seaweedfs-admin-grpc-{p['admin'] + 10000}.sock",
            f"/tmp/seaweedfs-s3-grpc-{port + 10000}.sock",
        ]
        probe = f"http://127.0.0.1:{port}/"
    with open(workdir / f"{backend}.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
    try:
        _wait_http(probe, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        for sock in sockets:  # weed's gRPC sockets in /tmp (no flag moves them)
            Path(sock).unlink(missing_ok=True)


def _timed(fn: Callable[[], Any], fsync_path: Path | None = None) -> float:
    """Seconds ``fn`` takes, plus an fsync of ``fsync_path`` (equal durability with our store)."""
    os.sync()  # start clean: no earlier step's dirty pages being written back during this one
    start = time.perf_counter()
    fn()
    if fsync_path is not None:
        fd = os.open(fsync_path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return time.perf_counter() - start


async def _ours_round_trip(
    args: argparse.Namespace, store: BlobStore, src: Path, out: Path, i: int, results: dict[str, list[float]]
) -> SlotRef:
    """Time one upload of `src` and one download to `out` through our store, caches dropped before
    each; returns the ref the caller deletes."""
    from storage.ids import SlotRef
    from storage.slotfile.reader import whole_file_crc32

    ref = SlotRef("bench", "s", i + 1)
    os.sync()
    start = time.perf_counter()
    crc = None if args.no_crc_hint else await asyncio.to_thread(whole_file_crc32, src)
    await store.put_file(ref, src, model="be" * 32, n_tokens=1024, crc32=crc)
    results["ours_up"].append(time.perf_counter() - start)
    os.sync()
    start = time.perf_counter()
    await store.get_to_file(ref, out)
    results["ours_down"].append(time.perf_counter() - start)
    return ref


async def _bench_s3(args: argparse.Namespace, endpoint: str, src: Path, work: Path) -> dict[str, float]:
    from boto3.s3.transfer import TransferConfig

    from storage.blobs.s3client import make_s3_client
    from storage.blobs.s3store import S3Store

    part, conc = args.part_size_mib * MiB, args.concurrency
    client = make_s3_client(
        endpoint_url=endpoint,
        access_key=args.access_key,
        secret_key=args.secret_key,
        max_pool_connections=conc + 4,
    )
    try:
        client.create_bucket(Bucket=args.bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    cfg = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=conc)
    results: dict[str, list[float]] = {k: [] for k in ("ours_up", "ours_down", "raw_up", "raw_down")}
    async with S3Store(
        client, args.bucket, prefix="bench", part_size=part, concurrency=conc, fsync=not args.no_fsync
    ) as store:
        await store.native_conditional_writes()  # the one-off probe is not part of a transfer
        for i in range(args.repeat):
            ref = await _ours_round_trip(args, store, src, work / "ours.out", i, results)
            key, out = f"raw/{i}.slot", work / "raw.out"
            sync = None if args.no_fsync else out
            up = functools.partial(client.upload_file, str(src), args.bucket, key, Config=cfg)
            down = functools.partial(client.download_file, args.bucket, key, str(out), Config=cfg)
            results["raw_up"].append(await asyncio.to_thread(_timed, up))
            results["raw_down"].append(await asyncio.to_thread(_timed, down, sync))
            await store.delete(ref)
            client.delete_object(Bucket=args.bucket, Key=key)
            (work / "ours.out").unlink()
            (work / "raw.out").unlink()
    client.close()
    return {k: min(v) for k, v in results.items()}


async def _bench_local(args: argparse.Namespace, src: Path, work: Path) -> dict[str, float]:
    from storage.blobs.localstore import LocalStore

    conc = max(1, min(args.concurrency, os.cpu_count() or 1))
    store = LocalStore(work / "store", prefix="bench", fsync=not args.no_fsync, concurrency=conc)
    results: dict[str, list[float]] = {k: [] for k in ("ours_up", "ours_down", "raw_up", "raw_down")}
    for i in range(args.repeat):
        ref = await _ours_round_trip(args, store, src, work / "ours.out", i, results)
        copy, out = work / "raw.copy", work / "raw.out"
        sync = not args.no_fsync
        results["raw_up"].append(
            _timed(functools.partial(shutil.copyfile, src, copy), copy if sync else None)
        )
        results["raw_down"].append(
            _timed(functools.partial(shutil.copyfile, copy, out), out if sync else None)
        )
        await store.delete(ref)
        for name in ("ours.out", "raw.copy", "raw.out"):
            (work / name).unlink()
    await store.aclose()
    return {k: min(v) for k, v in results.items()}


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name):
            return float(line.split()[-1])
    return 0.0


SESSION = "bench-agent"
SYSTEM = (
    "You are a coding agent with tools: read_file(path), write_file(path, text), run(cmd). "
    "Plan, act, check the result, and report briefly. "
)


def _model(args: argparse.Namespace, work: Path) -> str:
    from native.model_gen import cached_model

    return str(args.model or cached_model(Path.home() / ".cache" / "slotkeeper", "qwen35", size=args.size))


def _serve(
    work: Path, store: ServedStore, model: str, args: argparse.Namespace, env: dict[str, str]
) -> Serve:
    flags = [
        *("--data-dir", str(store.data)),
        *store.flags(),
        *("--model", model),
        *("--slots", "1"),
        *("--ctx", str(args.ctx)),
    ]
    flags += ["--log-level", "warning", "--store-compression", args.store_compression]
    try:
        return start_serve(work, "serve", flags, env)
    except RuntimeError:  # a port taken between the probe and the bind: once more, on new ports
        return start_serve(work, "serve", flags, env)


def _messages(n_system: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM * n_system}]


def session_suite(
    args: argparse.Namespace, work: Path, store: ServedStore, env: dict[str, str]
) -> SessionReport:
    """``--turns`` turns of one session; after each: bytes written, bytes stored, a full save."""
    model = _model(args, work)
    serve = _serve(work, store, model, args, env)
    rows: list[TurnRow] = []
    msgs = _messages(args.system_repeat)
    written_metric = 'slotkeeper_gateway_store_written_bytes_total{why="after-turn"}'
    try:
        for turn in range(args.turns):
            msgs.append({"role": "user", "content": f"Step {turn}: run the tests and fix what fails."})
            before = _metric(serve.url, written_metric)
            body = {"model": "any", "messages": msgs, "max_tokens": 8, "temperature": 0}
            r = httpx.post(
                serve.url + "/v1/chat/completions", headers={"X-Session-Id": SESSION}, json=body, timeout=900
            )
            r.raise_for_status()
            done = chat_answer(r.json())
            tokens = done.prompt_tokens()
            msgs.append({"role": "assistant", "content": done.content})

            def durable(t: int = turn) -> bool:
                rec = httpx.get(f"{serve.url}/v1/sessions/{SESSION}", timeout=10).json()
                return int(rec.get("generation", 0)) >= t + 1

            eventually(f"turn {turn} durable", durable, timeout_s=300)
            full = decode(Manifest, store.newest(SESSION)[1]).plan.size
            stored = int(eventually("collection settled", lambda: _settled(store), timeout_s=300))
            written = _metric(serve.url, written_metric) - before
            rows.append(TurnRow(turn, tokens, full, written, stored))
            print(
                f"  turn {turn}: {tokens} tokens, full save {full}, wrote {int(written)} "
                f"({written / full:.3f}x), stores {stored} ({stored / full:.3f}x)",
                flush=True,
            )
    finally:
        serve.close()
    later = rows[1:] or rows
    return SessionReport(
        turns=rows,
        written_total=sum(r.written for r in rows),
        full_save_per_turn_total=sum(r.full for r in rows),
        median_written_over_full=statistics.median(r.written / r.full for r in later),
        max_written_over_full=max(r.written / r.full for r in later),
        max_stored_over_full=max(r.stored / r.full for r in rows),
    )


def _generation(url: str, session: str) -> int:
    return int(httpx.get(f"{url}/v1/sessions/{session}", timeout=10).json().get("generation", 0))


def _settled(store: ServedStore) -> int | None:
    """Stored bytes once two listings agree (the collection after a save has run)."""
    first = sum(store.objects().values())
    time.sleep(0.2)  # two listings apart: a collection in flight shows as a difference
    second = sum(store.objects().values())
    return second if first == second else None


async def _restore_times(store: ServedStore, work: Path, repeat: int) -> RestoreTimes:
    """Seconds: the newest generation assembled from its chunks, and a raw read of as many bytes."""
    from storage.blobs.localstore import LocalStore
    from storage.blobs.s3client import make_s3_client
    from storage.blobs.s3store import S3Store
    from storage.chunks.chunkstore import ChunkedStore
    from storage.chunks.ledger import ChunkLedger
    from storage.ids import parse_manifest_key
    from storage.index.keyspace import in_process_redis

    key, _ = store.newest(SESSION)
    ref = parse_manifest_key(store.prefix, key)
    assert ref is not None
    client = store.client() if store.endpoint else None
    # ours through the client a node builds (storage.blobs.s3client: botocore validates no response
    # checksums; a plain boto3 client CRCs every GET of a piece stored with one, which no restore does)
    ours_client = (
        make_s3_client(endpoint_url=store.endpoint, access_key=store.access_key, secret_key=store.secret_key)
        if store.endpoint
        else None
    )
    inner = (
        S3Store(ours_client, store.bucket, prefix=store.prefix)
        if ours_client
        else LocalStore(store.data / "blobs", prefix=store.prefix)
    )
    ours: list[float] = []
    raw: list[float] = []
    async with ChunkedStore(inner, ChunkLedger(in_process_redis())) as chunked:  # reads either
        dest, out = work / "restored.slot", work / "raw.slot"
        await chunked.get_to_file(ref, dest, verify=False)
        size = dest.stat().st_size
        if client is not None:  # the same bytes as one object, read raw with boto3's transfer manager
            from boto3.s3.transfer import TransferConfig

            whole = f"{store.prefix}-raw/whole.slot"
            client.upload_file(str(dest), store.bucket, whole)
            cfg = TransferConfig(multipart_chunksize=8 * MiB, max_concurrency=8)
            read_raw = functools.partial(client.download_file, store.bucket, whole, str(out), Config=cfg)
        else:
            read_raw = functools.partial(shutil.copyfile, dest, out)  # no fsync: ours has none
        for _ in range(repeat):  # interleaved: this host's noise hits both alike
            dest.unlink(missing_ok=True)
            os.sync()
            t0 = time.perf_counter()
            await chunked.get_to_file(ref, dest, verify=False)  # as a node restores (the engine checks)
            ours.append(time.perf_counter() - t0)
            out.unlink(missing_ok=True)
            os.sync()  # (neither pays for the other's written-back pages)
            raw.append(_timed(read_raw))
    for c in (client, ours_client):
        if c is not None:
            c.close()
    pairs = sorted(r / o for o, r in zip(ours, raw, strict=True))
    return RestoreTimes(size, min(ours), min(raw), pairs)


def ttft_suite(args: argparse.Namespace, work: Path, store: ServedStore, env: dict[str, str]) -> TtftReport:
    """A session of the same length as ``session``'s; restart (spill cache off); the restored turn's
    TTFT, then the next (live) turn's, same number of new tokens. The live turn starts once the
    restored one is durable, as an agent's next turn comes after its tools ran: sent at once it
    would share the cores with the restored turn's write-behind save."""
    model = _model(args, work)
    env = {**env, "SLOTKEEPER_SPILL_BYTES": "0"}  # a restore reads the store, never a local copy
    session = "ttft-agent"
    msgs = _messages(args.system_repeat)
    serve = _serve(work, store, model, args, env)
    try:
        for turn in range(3):
            msgs.append({"role": "user", "content": f"Step {turn}: run the tests and fix what fails."})
            res = stream_turn(serve.url, "any", msgs, session, 8)
            msgs.append({"role": "assistant", "content": res.content})
        serve.terminate(300)  # drains: the session is in the store
        serve = _serve(work, store, model, args, env)
        out: dict[str, TtftTurn] = {}
        before = 0
        for name, turn in (("restored", 3), ("live", 4)):
            if name == "live" and not args.next_turn_at_once:

                def restored_durable(g: int = before) -> bool:
                    return _generation(serve.url, session) > g

                eventually("the restored turn durable", restored_durable, timeout_s=300)
            before = _generation(serve.url, session)
            msgs.append({"role": "user", "content": f"Step {turn}: run the tests and fix what fails."})
            res = stream_turn(serve.url, "any", msgs, session, 8)
            msgs.append({"role": "assistant", "content": res.content})
            prompt_n = res.timings.prompt_n if res.timings else None
            out[name] = TtftTurn(res.ttft_ms, res.cache, prompt_n)
    finally:
        serve.close()
    restored, live = out["restored"], out["live"]
    return TtftReport(restored, live, restored.ttft_ms / live.ttft_ms)


def _print_session(rep: SessionReport) -> None:
    print("session: turn  tokens  full save  written  stored   written/full  stored/full")
    for r in rep.turns:
        print(
            f"  {r.turn:>11} {r.tokens:>7} {r.full:>10} {int(r.written):>8} {r.stored:>8} "
            f"{r.written / r.full:>13.3f} {r.stored / r.full:>12.3f}"
        )
    total, full = rep.written_total, rep.full_save_per_turn_total
    median, most = rep.median_written_over_full, rep.max_written_over_full
    print(
        f"  written over {len(rep.turns)} turns: {total / MiB:.1f} MiB chunked vs {full / MiB:.1f} MiB "
        f"with a full save per turn ({total / full:.3f}x); median turn {median:.3f}x of a full save, "
        f"max {most:.3f}x; stored at most {rep.max_stored_over_full:.3f}x a full save"
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slotkeeper bench storage", description=__doc__.split("\n")[0])
    p.add_argument(
        "--suite",
        choices=["all", "transfer", "session", "restore", "ttft"],
        default="all",
        help="what to measure (restore runs the session suite first)",
    )
    p.add_argument("--repeat", type=int, default=1, help="runs; the best of each is reported")
    p.add_argument("--dir", type=Path, help="work directory (default: a temporary one)")
    p.add_argument("--json", action="store_true", help="also print the whole report as JSON")
    g = p.add_argument_group("store")
    g.add_argument(
        "--backend",
        choices=["moto", "seaweedfs", "endpoint", "local"],
        default="seaweedfs",
        help="an S3 server started for the run, an existing one (--endpoint), or the local store",
    )
    g.add_argument("--endpoint", help="S3 endpoint for --backend endpoint")
    g.add_argument("--bucket", default="bench", help="created when missing")
    g.add_argument("--access-key", default="bench")
    g.add_argument("--secret-key", default="bench")
    g = p.add_argument_group("transfer")
    g.add_argument("--size-mib", type=int, default=512, help="the slot file's size")
    g.add_argument("--part-size-mib", type=int, default=8, help="S3 part size, ours and raw")
    g.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="parts in flight, ours and raw (local: at most one per CPU)",
    )
    g.add_argument("--no-fsync", action="store_true", help="no fsync of written files (ours or raw)")
    g.add_argument("--no-crc-hint", action="store_true", help="let put_file compute the CRC in a first pass")
    g = p.add_argument_group("session, restore, ttft")
    g.add_argument("--model", help="GGUF (default: the generated qwen35 of --size)")
    g.add_argument("--size", choices=["tiny", "bench"], default="tiny", help="generated model size")
    g.add_argument("--turns", type=int, default=50, help="session: turns")
    g.add_argument("--system-repeat", type=int, default=60, help="system prompt: sentence repeats")
    g.add_argument("--ctx", type=int, default=16384, help="serve's --ctx")
    g.add_argument(
        "--store-compression",
        choices=["on", "off", "auto"],
        default="off",
        help="serve's: recurrent states stored compressed (auto: in S3 only)",
    )
    g.add_argument(
        "--next-turn-at-once",
        action="store_true",
        help="ttft: send the live turn right after the restored one, beside its save",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``slotkeeper bench storage``; ``argv`` excludes the program name."""
    p = _parser()
    args = p.parse_args(argv)
    if args.backend == "endpoint" and not args.endpoint:
        p.error("--endpoint is required with --backend endpoint")
    from engine_pool.process import logs

    logs.configure("json", "warning")  # the tables, not every request
    logging.getLogger("httpx").setLevel(logging.WARNING)
    suites = {"transfer", "session", "restore", "ttft"} if args.suite == "all" else {args.suite}
    if "restore" in suites:
        suites.add("session")  # restores the session's newest generation
    transfer: Transfer | None = None
    session: SessionReport | None = None
    restore: RestoreTimes | None = None
    ttft: TtftReport | None = None
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        if args.backend in ("moto", "seaweedfs"):
            where: Any = server(args.backend, work)
        else:
            where = contextlib.nullcontext(args.endpoint)
        with where as endpoint:
            if "transfer" in suites:
                transfer = _transfer(args, work, endpoint)

            def served(name: str) -> ServedStore:
                return ServedStore(
                    work / name,
                    f"{name}{os.getpid()}",
                    endpoint,
                    args.bucket,
                    access_key=args.access_key,
                    secret_key=args.secret_key,
                )

            env = {**os.environ, **served("any").env()}
            if endpoint:
                client = served("any").client()
                with contextlib.suppress(Exception):  # exists already
                    client.create_bucket(Bucket=args.bucket)
                client.close()
            if "session" in suites:
                store = served("session")
                session = session_suite(args, work, store, env)
                _print_session(session)
                if "restore" in suites:
                    restore = asyncio.run(_restore_times(store, work, max(args.repeat, 3)))
                    _print_restore(restore)
            if "ttft" in suites:
                store = served("ttft")
                ttft = ttft_suite(args, work, store, env)
                back, live = ttft.restored, ttft.live
                print(
                    f"ttft: restored turn {back.ttft_ms:.0f} ms ({back.cache}, prompt_n "
                    f"{back.prompt_n}) vs live turn {live.ttft_ms:.0f} ms ({live.cache}, "
                    f"prompt_n {live.prompt_n}): {ttft.ratio:.2f}x"
                )
    if args.json:
        print(json.dumps(StorageReport(args.backend, transfer, session, restore, ttft).to_json()))
    return 0


def _print_restore(r: RestoreTimes) -> None:
    ratio = r.raw_s / r.ours_s
    verdict = "ok" if ratio >= TARGET else "BELOW TARGET"
    n, ours, raw = r.bytes, r.ours_s, r.raw_s
    print(
        f"restore: {n / MiB:.1f} MiB from chunks in {ours * 1000:.1f} ms ({n / ours / 1e6:.0f} MB/s) "
        f"vs a raw read {raw * 1000:.1f} ms ({n / raw / 1e6:.0f} MB/s): ratio {ratio:.2f} "
        f"({verdict}, target {TARGET})"
    )
    pairs = r.pair_ratios  # (each restore against the raw read right after it: the noise of one moment)
    print(
        f"restore: ratio per pair {statistics.median(pairs):.2f} median, {pairs[0]:.2f}-{pairs[-1]:.2f} "
        f"over {len(pairs)}"
    )


def _transfer(args: argparse.Namespace, work: Path, endpoint: str | None) -> Transfer:
    src = work / "bench.slot"
    write_slot_file(src, args.size_mib * MiB)
    size = src.stat().st_size
    if args.backend == "local":
        times = asyncio.run(_bench_local(args, src, work))
    else:
        assert endpoint is not None
        times = asyncio.run(_bench_s3(args, endpoint, src, work))
    src.unlink()
    rates = {k: size / v / 1e6 for k, v in times.items()}
    ratios = {
        "upload": rates["ours_up"] / rates["raw_up"],
        "download": rates["ours_down"] / rates["raw_down"],
    }
    parts = f"parts {args.part_size_mib} MiB x {args.concurrency}"
    print(
        f"transfer {args.backend}: {size / MiB:.0f} MiB, {parts}, "
        f"fsync {'on (raw copies fsync too)' if not args.no_fsync else 'off'}"
    )
    for op, ours, raw in (("upload", "ours_up", "raw_up"), ("download", "ours_down", "raw_down")):
        verdict = "ok" if ratios[op] >= TARGET else "BELOW TARGET"
        print(
            f"  {op:<8} storage {rates[ours]:8.1f} MB/s   raw {rates[raw]:8.1f} MB/s   "
            f"ratio {ratios[op]:.2f} ({verdict}, target {TARGET})"
        )
    return Transfer(size, args.part_size_mib, args.concurrency, not args.no_fsync, rates, ratios, TARGET)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

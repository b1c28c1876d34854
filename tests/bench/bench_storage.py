"""``slotkeeper bench storage``: slot-file transfer throughput of storage/ against a raw copy.

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
import functools
import json
import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

MiB = 1 << 20
TARGET = 0.7


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
        code = ("import sys,time\nfrom moto.server import ThreadedMotoServer\n"
                "ThreadedMotoServer(ip_address='127.0.0.1', port=int(sys.argv[1]), verbose=False).start()\n"
                "time.sleep(10**9)\n")  # fmt: skip
        cmd = [sys.executable, "-c", code, str(port)]
        probe = f"http://127.0.0.1:{port}/moto-api/"
        sockets = []
    else:
        port = _free_port(10000)
        p = {n: _free_port(10000) for n in ("master", "volume", "filer", "admin")}
        (workdir / "weed").mkdir()
        cmd = ["weed", "mini", f"-dir={workdir / 'weed'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               "-master.telemetry=false", f"-master.port={p['master']}", f"-volume.port={p['volume']}",
               f"-filer.port={p['filer']}", f"-s3.port={port}", f"-admin.port={p['admin']}",
               "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
               f"-s3.localSocket={workdir}/s3.sock", f"-filer.localSocket={workdir}/filer.sock"]  # fmt: skip
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


async def _bench_s3(args: argparse.Namespace, endpoint: str, src: Path, work: Path) -> dict[str, float]:
    from boto3.s3.transfer import TransferConfig

    from storage.ids import SlotRef
    from storage.s3client import make_s3_client
    from storage.s3store import S3Store
    from storage.slotfile import whole_file_crc32

    part, conc = args.part_size_mib * MiB, args.concurrency
    client = make_s3_client(endpoint_url=endpoint, access_key=args.access_key, secret_key=args.secret_key,
                            max_pool_connections=conc + 4)  # fmt: skip
    try:
        client.create_bucket(Bucket=args.bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    cfg = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=conc)
    results: dict[str, list[float]] = {k: [] for k in ("ours_up", "ours_down", "raw_up", "raw_down")}
    async with S3Store(client, args.bucket, prefix="bench", part_size=part, concurrency=conc,
                       fsync=not args.no_fsync) as store:  # fmt: skip
        await store.native_conditional_writes()  # the one-off probe is not part of a transfer
        for i in range(args.repeat):
            ref = SlotRef("bench", "s", i + 1)
            os.sync()
            start = time.perf_counter()
            crc = None if args.no_crc_hint else await asyncio.to_thread(whole_file_crc32, src)
            await store.put_file(ref, src, model="be" * 32, n_tokens=1024, crc32=crc)
            results["ours_up"].append(time.perf_counter() - start)
            os.sync()
            start = time.perf_counter()
            await store.get_to_file(ref, work / "ours.out")
            results["ours_down"].append(time.perf_counter() - start)
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
    from storage.ids import SlotRef
    from storage.localstore import LocalStore
    from storage.slotfile import whole_file_crc32

    conc = max(1, min(args.concurrency, os.cpu_count() or 1))
    store = LocalStore(work / "store", prefix="bench", fsync=not args.no_fsync, concurrency=conc)
    results: dict[str, list[float]] = {k: [] for k in ("ours_up", "ours_down", "raw_up", "raw_down")}
    for i in range(args.repeat):
        ref = SlotRef("bench", "s", i + 1)
        os.sync()
        start = time.perf_counter()
        crc = None if args.no_crc_hint else await asyncio.to_thread(whole_file_crc32, src)
        await store.put_file(ref, src, model="be" * 32, n_tokens=1024, crc32=crc)
        results["ours_up"].append(time.perf_counter() - start)
        os.sync()
        start = time.perf_counter()
        await store.get_to_file(ref, work / "ours.out")
        results["ours_down"].append(time.perf_counter() - start)
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``slotkeeper bench storage``; ``argv`` excludes the program name."""
    p = argparse.ArgumentParser(prog="slotkeeper bench storage", description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=["moto", "seaweedfs", "endpoint", "local"], default="seaweedfs")
    p.add_argument("--endpoint", help="S3 endpoint for --backend endpoint")
    p.add_argument("--bucket", default="bench")
    p.add_argument("--access-key", default="bench")
    p.add_argument("--secret-key", default="bench")
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--part-size-mib", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--repeat", type=int, default=1, help="runs; the best of each is reported")
    p.add_argument("--no-fsync", action="store_true", help="no fsync of written files (ours or raw)")
    p.add_argument("--no-crc-hint", action="store_true", help="let put_file compute the CRC in a first pass")
    p.add_argument("--dir", type=Path, help="work directory (default: a temporary one)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.backend == "endpoint" and not args.endpoint:
        p.error("--endpoint is required with --backend endpoint")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        src = work / "bench.slot"
        write_slot_file(src, args.size_mib * MiB)
        size = src.stat().st_size
        if args.backend == "local":
            times = asyncio.run(_bench_local(args, src, work))
        elif args.backend == "endpoint":
            times = asyncio.run(_bench_s3(args, args.endpoint, src, work))
        else:
            with server(args.backend, work) as endpoint:
                times = asyncio.run(_bench_s3(args, endpoint, src, work))
    rates = {k: size / v / 1e6 for k, v in times.items()}
    ratios = {
        "upload": rates["ours_up"] / rates["raw_up"],
        "download": rates["ours_down"] / rates["raw_down"],
    }
    report = {"backend": args.backend, "bytes": size, "part_size_mib": args.part_size_mib,
              "concurrency": args.concurrency, "fsync": not args.no_fsync, "mb_per_s": rates,
              "ratio": ratios, "target": TARGET}  # fmt: skip
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{args.backend}: {size / MiB:.0f} MiB, parts {args.part_size_mib} MiB x {args.concurrency}, "
              f"fsync {'on (raw copies fsync too)' if not args.no_fsync else 'off'}")  # fmt: skip
        for op, ours, raw in (("upload", "ours_up", "raw_up"), ("download", "ours_down", "raw_down")):
            verdict = "ok" if ratios[op] >= TARGET else "BELOW TARGET"
            print(f"  {op:<8} storage {rates[ours]:8.1f} MB/s   raw {rates[raw]:8.1f} MB/s   "
                  f"ratio {ratios[op]:.2f} ({verdict}, target {TARGET})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""`slotkeeper bench resume --tokens 32768,65536,131072`: long agent sessions restored.

For each length, in process on the native core (default: the qwen35 bench model): an agent session
grown turn by turn to that length (a system prompt, then tool outputs of `--turn-tokens` and short
answers, a checkpoint hint at each turn's start), its live next turn, and the same next turn after
the session's state went

- to the node's spill cache (a slot file on the local disk) and back, read from the page cache
  (the file just written) and from the disk (its pages dropped first: `posix_fadvise`);
- to S3 (SeaweedFS, stored in chunks as a node stores them) and back on another node: fetched into
  a file as a node's fill does, then restored.

Each restore into a fresh engine (a restart). Per restore: its milliseconds and GB/s, the peak of
the process's resident memory above where it stood before (anonymous and file-backed apart: a
mapped slot file's pages are the page cache's, which the kernel takes back under pressure); the
restored next turn's time against the live one's, and whether its greedy tokens are the live
ones'. Per length: the slot file's size and checkpoints (the stored ladder) and the cold session's
time. `--json FILE` writes every number.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import native
from gateway.bench.harness.prompts import CHUNK, SYSTEM

T = TypeVar("T")
MiB = 1 << 20


@dataclass(frozen=True)
class Memory:
    """Resident memory of this process above where it stood before a step, at its peak (MiB):
    all of it, and the anonymous part (sampled) — the rest is file-backed (mapped files)."""

    peak_mib: float
    peak_anon_mib: float


@dataclass(frozen=True)
class RestoreRow:
    """One way back: `fetch_ms` (from the store into a file; 0 from the spill cache), `restore_ms`
    (the engine's load of the file), `turn_ms` (the next turn after it, wall), `prompt_n`."""

    source: str
    fetch_ms: float
    restore_ms: float
    restore_gbps: float
    turn_ms: float
    prompt_n: int
    same_tokens: bool
    fetch_memory: Memory | None
    restore_memory: Memory


@dataclass(frozen=True)
class LengthReport:
    tokens: int
    turns: int
    cold_s: float
    slot_file_bytes: int
    checkpoints_live: int
    checkpoints_stored: int
    save_ms: float
    live_turn_ms: float
    live_prompt_n: int
    restores: list[RestoreRow]


# -- memory --------------------------------------------------------------------------------------------
def _status_kib(*fields: str) -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in fields:
                out[name] = int(rest.split()[0])
    return out


@contextmanager
def _peak_memory() -> Iterator[list[Memory]]:
    """The body's peak resident memory above the start: the kernel's high-water mark (reset first,
    `clear_refs` 5) for the whole, a 2 ms sampler for the anonymous part. Yields a list the result
    is appended to at exit."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kib("VmRSS", "RssAnon")
    peak_anon, done = [base["RssAnon"]], threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            peak_anon[0] = max(peak_anon[0], _status_kib("RssAnon")["RssAnon"])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out: list[Memory] = []
    try:
        yield out
    finally:
        done.set()
        sampler.join()
        now = _status_kib("VmHWM", "RssAnon")
        anon = max(peak_anon[0], now["RssAnon"]) - base["RssAnon"]
        out.append(Memory(round((now["VmHWM"] - base["VmRSS"]) / 1024, 1), round(anon / 1024, 1)))


def _drop_pages(path: Path) -> None:
    """The file's pages out of the page cache (written back first), so the next read is the disk's."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# -- the session ---------------------------------------------------------------------------------------
def _engine(model: str, args: argparse.Namespace, n_ctx: int) -> native.Engine:
    return native.Engine(
        native.EngineConfig(
            model,
            n_slots=1,
            n_ctx=n_ctx,
            n_batch=512,
            n_ubatch=512,
            n_threads=args.threads,
            checkpoint_interval=2048,
        )
    )


def _request(prompt: list[int], n: int, hints: list[int] | None = None) -> native.RequestParams:
    p = native.RequestParams(prompt)
    p.n_predict = n
    p.temperature = 0.0
    p.checkpoint_hints = hints or []
    return p


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1000


def _grow(eng: native.Engine, tokens: int, turn_tokens: int, n_predict: int) -> tuple[list[int], int]:
    """An agent session of about ``tokens`` tokens in the engine's slot 0, turn by turn (raw
    tokens, the prompt growing by a tool output and the answer each turn); its tokens and turns."""
    chunk = eng.tokenize(CHUNK, False)
    history = eng.tokenize(SYSTEM, True)
    turns = 0
    while len(history) < tokens:
        turns += 1
        start = len(history)
        tool = eng.tokenize(f"\nTool output {turns}:\n", False)
        while len(tool) < turn_tokens and start + len(tool) < tokens:
            tool += chunk
        prompt = history + tool
        done = eng.generate(0, _request(prompt, n_predict, hints=[start]))
        history = prompt + list(done.tokens)
    return history, turns


def _measure(model: str, args: argparse.Namespace, tokens: int, work: Path, s3: str | None) -> LengthReport:
    n_ctx = tokens + args.turn_tokens + 1024
    eng = _engine(model, args, n_ctx)
    t0 = time.perf_counter()
    history, turns = _grow(eng, tokens, args.turn_tokens, args.n_predict)
    cold_s = time.perf_counter() - t0
    live_ckpts = eng.slots()[0].n_checkpoints
    nxt = history + eng.tokenize("\nNow fix the failing test and run it again.\n", False)
    path = work / "session.slot"
    saved = eng.save_slot(0, str(path))
    live, live_ms = _timed(lambda: eng.generate(0, _request(nxt, args.n_predict)))
    assert live.timings is not None
    eng.close()
    print(
        f"{tokens} tokens ({len(history)} in {turns} turns, cold {cold_s:.0f} s): slot file "
        f"{saved.n_bytes / MiB:.1f} MiB, {saved.n_checkpoints} checkpoints stored of {live_ckpts}; "
        f"live next turn {live_ms:.0f} ms, prompt_n {live.timings.prompt_n}"
    )

    def restored(source: str, file: Path, fetch_ms: float = 0.0, fetched: Memory | None = None) -> RestoreRow:
        fresh = _engine(model, args, n_ctx)
        try:
            with _peak_memory() as mem:
                info, ms = _timed(lambda: fresh.restore_slot(0, str(file)))
            done, turn_ms = _timed(lambda: fresh.generate(0, _request(nxt, args.n_predict)))
        finally:
            fresh.close()
        assert done.timings is not None
        row = RestoreRow(
            source,
            round(fetch_ms, 1),
            round(ms, 1),
            round(info.n_bytes / ms / 1e6, 2),
            round(turn_ms, 1),
            done.timings.prompt_n,
            list(done.tokens) == list(live.tokens),
            fetched,
            mem[0],
        )
        print(
            f"  {source:28} fetch {row.fetch_ms:7.0f} ms  restore {row.restore_ms:6.0f} ms "
            f"({row.restore_gbps:.2f} GB/s, peak +{row.restore_memory.peak_mib:.0f} MiB, anon "
            f"+{row.restore_memory.peak_anon_mib:.0f})  next turn {row.turn_ms:6.0f} ms "
            f"({(row.fetch_ms + row.restore_ms + row.turn_ms) / live_ms:.2f}x live), "
            f"prompt_n {row.prompt_n}, same tokens: {row.same_tokens}"
            + (
                f"; the fetch's peak +{fetched.peak_mib:.0f} MiB, anon +{fetched.peak_anon_mib:.0f}"
                if fetched
                else ""
            )
        )
        return row

    rows = [restored("spill cache, page cache", path)]
    _drop_pages(path)
    rows.append(restored("spill cache, disk", path))
    if s3 is not None:
        dest = work / "fetched.slot"
        fetch_ms, fetched = asyncio.run(_through_s3(s3, path, dest, model, len(history)))
        rows.append(restored("S3 (SeaweedFS), another node", dest, fetch_ms, fetched))
        dest.unlink()
    path.unlink()
    return LengthReport(
        tokens,
        turns,
        round(cold_s, 1),
        saved.n_bytes,
        live_ckpts,
        saved.n_checkpoints,
        round(saved.ms, 1),
        round(live_ms, 1),
        live.timings.prompt_n,
        rows,
    )


async def _through_s3(
    endpoint: str, path: Path, dest: Path, model: str, n_tokens: int
) -> tuple[float, Memory]:
    """The slot file stored in chunks in S3, then fetched into ``dest`` as another node's fill
    does: the fetch's milliseconds and peak memory."""
    from storage.blobs.s3client import make_s3_client
    from storage.blobs.s3store import S3Store
    from storage.chunks.chunkstore import ChunkedStore
    from storage.chunks.ledger import ChunkLedger
    from storage.ids import SlotRef
    from storage.index.keyspace import in_process_redis

    client = make_s3_client(endpoint_url=endpoint, access_key="any", secret_key="any")
    try:
        async with ChunkedStore(
            S3Store(client, "bench", prefix="long"), ChunkLedger(in_process_redis())
        ) as st:
            ref = SlotRef("bench", "long", 1)
            await st.put_file(ref, path, model=model, n_tokens=n_tokens)
            with _peak_memory() as mem:
                t0 = time.perf_counter()
                await st.get_to_file(ref, dest, verify=False)  # as a node's fill (the engine checks)
                ms = (time.perf_counter() - t0) * 1000
            await st.delete(ref)
    finally:
        client.close()
    return ms, mem[0]


def run(model: str, args: argparse.Namespace, lengths: list[int]) -> list[LengthReport]:
    """Every length in turn (see the module doc); S3 unless `--no-s3` or no `weed` here."""
    from gateway.bench.harness.servers import weed_mini
    from storage.blobs.s3client import make_s3_client

    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-long-", dir=args.workdir) as tmp:
        work = Path(tmp)
        if args.no_s3 or shutil.which("weed") is None:
            print("S3: not measured (" + ("--no-s3" if args.no_s3 else "no `weed` on PATH") + ")")
            return [_measure(model, args, n, work, None) for n in lengths]
        (work / "weed").mkdir()
        with weed_mini(work / "weed") as endpoint:
            client = make_s3_client(endpoint_url=endpoint, access_key="any", secret_key="any")
            client.create_bucket(Bucket="bench")
            client.close()
            return [_measure(model, args, n, work, endpoint) for n in lengths]

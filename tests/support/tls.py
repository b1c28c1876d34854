"""TLS for tests: a throw-away certificate authority (a CA and a server certificate for 127.0.0.1, as
PEM files; cryptography is a dependency of the package already), and a redis-server, a Redis
Cluster and a Sentinel set-up that speak TLS only (their nodes to each other too)."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gateway.bench.harness.servers import free_port, listening, stop, wait_until

NODE_TIMEOUT_MS = 1500


@dataclass(frozen=True)
class Certificates:
    ca: Path  # the CA's certificate: what a client trusts
    cert: Path  # the server's certificate (127.0.0.1), signed by the CA
    key: Path  # the server's private key


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )


def make_certificates(directory: Path) -> Certificates:
    """A CA and a server certificate for 127.0.0.1 (and localhost), valid for a day."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("slotkeeper test CA"))
        .issuer_name(_name("slotkeeper test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("127.0.0.1"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    out = Certificates(directory / "ca.pem", directory / "server.pem", directory / "server.key")
    out.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(out.key, key)
    return out


def _tls_flags(certs: Certificates, client_certificates: bool = False) -> list[str]:
    return [
        *("--tls-cert-file", str(certs.cert)),
        *("--tls-key-file", str(certs.key)),
        *("--tls-ca-cert-file", str(certs.ca)),
        *("--tls-auth-clients", "yes" if client_certificates else "no"),
        *("--tls-replication", "yes"),
    ]


def _tls_server(data: Path, port: int, flags: list[str], name: str = "redis") -> subprocess.Popen[bytes]:
    """A redis-server with TLS only on ``port`` (its plain port off), its files in ``data``."""
    data.mkdir(parents=True, exist_ok=True)
    argv = [
        "redis-server",
        *("--port", "0"),
        *("--tls-port", str(port)),
        *("--bind", "127.0.0.1"),
        *("--save", ""),
        *("--appendonly", "no"),
        *("--dir", str(data)),
        *flags,
    ]
    with open(data / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)
    wait_until(lambda: listening(port), proc, f"{name} (TLS)")
    return proc


def tls_cli(certs: Certificates, port: int, *words: str) -> str:
    """``redis-cli --tls`` against the server on ``port``: its output."""
    argv = ["redis-cli", "--tls", "--cacert", str(certs.ca), "-h", "127.0.0.1", "-p", str(port), *words]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False).stdout


def _until(what: str, check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s} s")
        time.sleep(0.1)


@contextmanager
def tls_redis(data: Path, certs: Certificates, *, client_certificates: bool = False) -> Iterator[int]:
    """A redis-server listening with TLS only (its plain port off), with ``certs``' server certificate;
    ``client_certificates``: it wants one signed by the CA from each client. Yields its port."""
    port = free_port()
    proc = _tls_server(data, port, _tls_flags(certs, client_certificates))
    try:
        yield port
    finally:
        stop(proc)


@contextmanager
def tls_cluster(data: Path, certs: Certificates, primaries: int = 3) -> Iterator[list[int]]:
    """A Redis Cluster of ``primaries`` primaries speaking TLS only, to clients and on its bus
    (`tls-cluster`); every slot assigned. Yields their ports."""
    ports = [free_port(also_plus=10000) for _ in range(primaries)]
    cluster = [
        *("--cluster-enabled", "yes"),
        *("--cluster-config-file", "nodes.conf"),
        *("--cluster-node-timeout", str(NODE_TIMEOUT_MS)),
        *("--tls-cluster", "yes"),
    ]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, port in enumerate(ports):
            procs.append(_tls_server(data / f"node{i}", port, [*_tls_flags(certs), *cluster]))
        hosts = [f"127.0.0.1:{p}" for p in ports]
        tls_cli(certs, ports[0], "--cluster", "create", *hosts, "--cluster-yes")
        _until(
            "the TLS cluster's state ok",
            lambda: all("cluster_state:ok" in tls_cli(certs, p, "cluster", "info") for p in ports),
        )
        yield ports
    finally:
        for proc in procs:
            stop(proc)


@contextmanager
def tls_sentinel(data: Path, certs: Certificates, master: str = "slotkeeper") -> Iterator[tuple[int, int]]:
    """A master and one sentinel watching it, both speaking TLS only (the sentinel to the master
    too). Yields (the master's port, the sentinel's)."""
    master_port, sentinel_port = free_port(), free_port()
    procs = [_tls_server(data / "master", master_port, _tls_flags(certs))]
    try:
        conf = data / "sentinel.conf"
        conf.write_text(
            f"sentinel monitor {master} 127.0.0.1 {master_port} 1\n"
            f"sentinel down-after-milliseconds {master} {NODE_TIMEOUT_MS}\n"
        )
        with open(data / "sentinel.log", "ab") as log:
            argv = ["redis-server", str(conf), "--sentinel", "--port", "0", "--tls-port", str(sentinel_port)]
            argv += ["--bind", "127.0.0.1", "--dir", str(data), *_tls_flags(certs)]
            procs.append(subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True))
        wait_until(lambda: listening(sentinel_port), procs[-1], "redis-sentinel (TLS)")

        def sees() -> bool:
            info = tls_cli(certs, sentinel_port, "info", "sentinel")
            return "status=ok" in info and f"address=127.0.0.1:{master_port}" in info

        _until("the sentinel seeing its master", sees)
        yield master_port, sentinel_port
    finally:
        for proc in procs:
            stop(proc)


def rediss_url(port: int, **options: Path | str) -> str:
    """The ``rediss://`` URL of the TLS redis-server on ``port``, with TLS options as its query."""
    query = "&".join(f"{k}={quote(str(v))}" for k, v in options.items())
    return f"rediss://127.0.0.1:{port}/0" + (f"?{query}" if query else "")

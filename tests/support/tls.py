"""TLS for tests: a throw-away certificate authority (a CA and a server certificate for 127.0.0.1, as
PEM files; cryptography is a dependency of the package already) and a redis-server that speaks TLS
only."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gateway.bench.harness.servers import free_port, listening, stop, wait_until


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


@contextmanager
def tls_redis(data: Path, certs: Certificates, *, client_certificates: bool = False) -> Iterator[int]:
    """A redis-server listening with TLS only (its plain port off), with ``certs``' server certificate;
    ``client_certificates``: it wants one signed by the CA from each client. Yields its port."""
    port = free_port()
    argv = [
        "redis-server",
        *("--port", "0"),
        *("--tls-port", str(port)),
        *("--bind", "127.0.0.1"),
        *("--tls-cert-file", str(certs.cert)),
        *("--tls-key-file", str(certs.key)),
        *("--tls-ca-cert-file", str(certs.ca)),
        *("--tls-auth-clients", "yes" if client_certificates else "no"),
        *("--save", ""),
        *("--appendonly", "no"),
        *("--dir", str(data)),
    ]
    with open(data / "redis.log", "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)
    try:
        wait_until(lambda: listening(port), proc, "redis-server (TLS)")
        yield port
    finally:
        stop(proc)


def rediss_url(port: int, **options: Path | str) -> str:
    """The ``rediss://`` URL of the TLS redis-server on ``port``, with TLS options as its query."""
    query = "&".join(f"{k}={quote(str(v))}" for k, v in options.items())
    return f"rediss://127.0.0.1:{port}/0" + (f"?{query}" if query else "")

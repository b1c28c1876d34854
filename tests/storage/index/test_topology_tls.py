"""storage.index.topology over TLS against a real redis-server (TLS only, its plain port off): a
`rediss://` URL with the CA reaches it, a client that does not trust its certificate is refused, and
a server that wants clients' certificates takes the one the URL names (`ssl_certfile`/`ssl_keyfile`).
`rediss-cluster://` reaches a Redis Cluster speaking TLS only (on its bus too), and
`rediss-sentinel://` a Sentinel and its master, both TLS only — each refused without the CA."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.tls import Certificates, make_certificates, rediss_url, tls_cluster, tls_redis, tls_sentinel

from storage.errors import StorageError, StoreUnavailable
from storage.index.session_index import SessionIndex
from storage.index.topology import connect


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def tls_port(tmp_path: Path, certificates: Certificates) -> Iterator[int]:
    with tls_redis(tmp_path, certificates) as port:
        yield port


@pytest.fixture
def mutual_port(tmp_path: Path, certificates: Certificates) -> Iterator[int]:
    with tls_redis(tmp_path, certificates, client_certificates=True) as port:
        yield port


async def _session_round_trip(url: str) -> None:
    """A record written and read back through the index."""
    client = connect(url, decode_responses=True)
    try:
        index = SessionIndex(client, prefix="tls")
        await index.create("acme", "s1", model="m")
        assert (await index.get("acme", "s1")).model == "m"
    finally:
        await client.aclose()


async def test_a_rediss_url_with_the_ca_reaches_a_tls_server(
    tls_port: int, certificates: Certificates
) -> None:
    await _session_round_trip(rediss_url(tls_port, ssl_ca_certs=certificates.ca))


async def test_a_server_the_client_does_not_trust_is_refused(
    tls_port: int, certificates: Certificates
) -> None:
    await _session_round_trip(rediss_url(tls_port, ssl_ca_certs=certificates.ca))  # it is up
    with pytest.raises(StorageError, match="(?i)certificate verify failed"):
        await _session_round_trip(rediss_url(tls_port))  # the system's CAs only


async def test_a_client_certificate_named_in_the_url_is_presented(
    mutual_port: int, certificates: Certificates
) -> None:
    mutual = rediss_url(
        mutual_port,
        ssl_ca_certs=certificates.ca,
        ssl_certfile=certificates.cert,
        ssl_keyfile=certificates.key,
    )
    await _session_round_trip(mutual)
    with pytest.raises(StorageError):  # the server drops the handshake
        await _session_round_trip(rediss_url(mutual_port, ssl_ca_certs=certificates.ca))


async def test_a_rediss_cluster_url_reaches_a_tls_cluster(tmp_path: Path, certificates: Certificates) -> None:
    with tls_cluster(tmp_path, certificates) as ports:
        seeds = ",".join(f"127.0.0.1:{p}" for p in ports[:2])
        url = f"rediss-cluster://{seeds}?ssl_ca_certs={certificates.ca}"
        for tenant in ("acme", "globex", "initech", "umbrella"):  # (spread over the shards)
            client = connect(url, decode_responses=True)
            try:
                index = SessionIndex(client, prefix="tls")
                await index.create(tenant, "s1", model="m")
                assert (await index.get(tenant, "s1")).model == "m"
            finally:
                await client.aclose()
        with pytest.raises(StoreUnavailable, match="(?i)certificate verify failed"):  # (a 503)
            await _session_round_trip(f"rediss-cluster://{seeds}")


async def test_a_rediss_sentinel_url_reaches_a_tls_master_through_a_tls_sentinel(
    tmp_path: Path, certificates: Certificates
) -> None:
    with tls_sentinel(tmp_path, certificates) as (_, sentinel):
        await _session_round_trip(
            f"rediss-sentinel://127.0.0.1:{sentinel}/slotkeeper?ssl_ca_certs={certificates.ca}"
        )
        with pytest.raises(StorageError):
            await _session_round_trip(f"rediss-sentinel://127.0.0.1:{sentinel}/slotkeeper")

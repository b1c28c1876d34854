"""storage.blobs.location: the store a process's settings name, and who closes its client."""

from __future__ import annotations

from pathlib import Path

from gateway.settings import GatewaySettings
from storage.blobs.localstore import LocalStore
from storage.blobs.location import open_blob_store
from storage.blobs.retry import RetryPolicy
from storage.blobs.s3store import S3Store

ENDPOINT = "http://127.0.0.1:9"  # never contacted: nothing is stored here


def where(bucket: str | None = None) -> GatewaySettings:
    """A gateway's settings naming the store (a node's name it with the same fields)."""
    keys = {"s3_access_key": "test", "s3_secret_key": "test"}
    return GatewaySettings(s3_bucket=bucket, s3_endpoint=ENDPOINT, s3_prefix="pfx", **keys)


async def test_without_a_bucket_the_local_directory(tmp_path: Path) -> None:
    store = open_blob_store(where(), tmp_path / "blobs")
    assert isinstance(store, LocalStore)
    assert store.root == tmp_path / "blobs" and store.prefix == "pfx"
    await store.aclose()


async def test_a_bucket_gets_a_client_of_its_own_closed_with_the_store(tmp_path: Path) -> None:
    retry = RetryPolicy(attempts=2)
    store = open_blob_store(where("bkt"), tmp_path / "blobs", retry=retry)
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix, store.retry, store.endpoint) == ("bkt", "pfx", retry, ENDPOINT)
    closed: list[bool] = []
    store.client.close = lambda: closed.append(True)
    await store.aclose()
    assert closed == [True]

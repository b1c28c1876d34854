"""Where a process's slot files live, as its settings say: an S3 bucket, or a local directory.

The node (`slotkeeper node`) and the gateway read the same `--s3-*` flags; `open_blob_store` is the
one place that turns them into a store, so both ends of a deployment agree on bucket and prefix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from storage.blobs.blobstore import BlobStore
from storage.blobs.localstore import LocalStore
from storage.blobs.retry import RetryPolicy


class StoreLocation(Protocol):
    """The settings that name the store (a node's and a gateway's settings both do)."""

    @property
    def s3_bucket(self) -> str | None: ...  # None: the local directory
    @property
    def s3_endpoint(self) -> str | None: ...
    @property
    def s3_region(self) -> str: ...
    @property
    def s3_access_key(self) -> str | None: ...  # None: boto3's own credential chain
    @property
    def s3_secret_key(self) -> str | None: ...
    @property
    def s3_prefix(self) -> str: ...


def open_blob_store(where: StoreLocation, local_root: Path, *, retry: RetryPolicy | None = None) -> BlobStore:
    """The bucket's store when `where` names one (with a client of its own, closed with it), else a
    store in `local_root`; `retry`: the S3 store's policy for transient failures."""
    if not where.s3_bucket:
        return LocalStore(local_root, prefix=where.s3_prefix)
    from storage.blobs.s3client import make_s3_client  # boto3 only where a bucket is used
    from storage.blobs.s3store import S3Store

    client = make_s3_client(
        endpoint_url=where.s3_endpoint,
        region=where.s3_region,
        access_key=where.s3_access_key,
        secret_key=where.s3_secret_key,
    )
    return S3Store(client, where.s3_bucket, prefix=where.s3_prefix, retry=retry, close_client=True)

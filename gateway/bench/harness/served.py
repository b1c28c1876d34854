"""What a `slotkeeper serve` run keeps in its store, seen from outside: its data directory's local
store or an S3 bucket. Shared by the chunked-session tests and `slotkeeper bench storage`."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.bench.harness.servers import CREDS


@dataclass(frozen=True)
class ManifestPlan:
    size: int  # the slot file's bytes: what a full save of the generation writes


@dataclass(frozen=True)
class Manifest:
    """What the benchmarks read of a chunked generation's manifest (the codec reads it)."""

    plan: ManifestPlan


@dataclass(frozen=True)
class ServedStore:
    """``data`` is serve's --data-dir; ``endpoint`` None means the local store under it."""

    data: Path
    prefix: str
    endpoint: str | None = None
    bucket: str = "slots"
    tenant: str = "default"
    access_key: str = CREDS["aws_access_key_id"]
    secret_key: str = CREDS["aws_secret_access_key"]

    def flags(self) -> list[str]:
        """serve's store flags (the data directory is the caller's)."""
        out = ["--s3-prefix", self.prefix]
        return out + (["--s3-endpoint", self.endpoint, "--s3-bucket", self.bucket] if self.endpoint else [])

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}

    def client(self) -> Any:
        """A boto3 client for the endpoint (the caller closes it)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
        )

    def objects(self) -> dict[str, int]:
        """Key -> size of everything stored for the tenant (chunks, checkpoints, tails, manifests)."""
        head = f"{self.prefix}/{self.tenant}/"
        if self.endpoint is None:
            root, out = self.data / "blobs", {}
            for p in (root / head).rglob("*"):
                with contextlib.suppress(FileNotFoundError):  # collected while we list
                    if p.is_file():
                        out[p.relative_to(root).as_posix()] = p.stat().st_size
            return out
        client = self.client()
        try:
            pages = client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=head)
            return {o["Key"]: int(o["Size"]) for page in pages for o in page.get("Contents", [])}
        finally:
            client.close()

    def read(self, key: str) -> bytes:
        if self.endpoint is None:
            return (self.data / "blobs" / key).read_bytes()
        client = self.client()
        try:
            return bytes(client.get_object(Bucket=self.bucket, Key=key)["Body"].read())
        finally:
            client.close()

    def stored_bytes(self) -> int:
        return sum(self.objects().values())

    def newest(self, session: str) -> tuple[str, Mapping[str, object]]:
        """The key and document of the session's newest manifest (`decode(Manifest, document)`
        reads what a bench needs of it)."""
        keys = sorted(k for k in self.objects() if k.endswith(".manifest") and f"/{session}/" in k)
        return keys[-1], json.loads(self.read(keys[-1]))

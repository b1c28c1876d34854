"""``slotkeeper reindex``: rebuild the session index from the blob store, the source of truth.

For every tenant in the store (or the ones named), the newest generation of every session is
looked up, its object metadata read, and the session recorded as ``spilled`` at that generation
— unless the index already knows that generation or a newer one (a live session keeps its slot
and only learns the newer durable generation). Running it twice changes nothing the second time.
Afterwards each tenant's stored-bytes counter is set to what the store holds for it, and a generation at or
below a deleted session's floor (a leftover copy) is not adopted.
The in-process index of a single machine runs :func:`reindex` at start-up to survive restarts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import structlog

from storage.blobs.blobstore import BlobInfo, BlobMeta, BlobStore
from storage.errors import StorageError
from storage.index.prefix_digests import split_routes
from storage.index.session_index import SessionIndex, SessionRecord, SessionState
from storage.index.topology import connect

log = structlog.get_logger("slotkeeper.storage")


@dataclass
class ReindexReport:
    tenants: int = 0
    sessions: int = 0
    restored: int = 0
    unchanged: int = 0
    skipped: list[str] = field(default_factory=list)  # keys whose metadata could not be used


async def reindex(
    store: BlobStore,
    index: SessionIndex,
    *,
    tenants: Iterable[str] | None = None,
    dry_run: bool = False,
    concurrency: int = 8,
) -> ReindexReport:
    """Record the newest stored generation of every session in ``index``; see the module doc."""
    names = list(tenants) if tenants is not None else [t async for t in store.list_tenants()]
    report = ReindexReport(tenants=len(names))
    gate = asyncio.Semaphore(concurrency)
    holders: dict[tuple[str, str], SessionRecord] = {}  # (tenant, shared/prompt digest) -> its newest session

    async def one(info: BlobInfo) -> None:
        async with gate:
            try:
                meta = await store.head(info.ref)
            except StorageError as exc:  # vanished since the listing, or foreign metadata
                log.warning("reindex.skipped", key=info.key, error=str(exc))
                report.skipped.append(info.key)
                return
            record = stored_record(info, meta)
            changed = False
            if dry_run:
                known = await index.find(record.tenant, record.session)
                changed = known is None or known.generation < record.generation
            else:
                changed = await adopt_stored(index, record)
                for digest in (record.shared, record.prompt) if changed else ():
                    # and a new session its shared prefix or its very prompt: the newest holder's
                    newest = holders.get((record.tenant, digest))
                    if digest and (newest is None or newest.last_used < record.last_used):
                        holders[(record.tenant, digest)] = record
            if changed:
                report.restored += 1
            else:
                report.unchanged += 1

    for tenant in names:
        latest = await store.latest_per_session(tenant)
        report.sessions += len(latest)
        await asyncio.gather(*(one(info) for info in latest.values()))
        for (_, shared), holder in holders.items():
            await index.add_shared(holder.tenant, holder.session, shared)
        holders.clear()
        if not dry_run:
            await index.set_stored_bytes(tenant, await store.stored_bytes(tenant))
    log.info(
        "reindex.done",
        dry_run=dry_run,
        **{k: v for k, v in asdict(report).items() if k != "skipped"},
        skipped=len(report.skipped),
    )
    return report


def stored_record(info: BlobInfo, meta: BlobMeta) -> SessionRecord:
    """The record of a session spilled at the stored generation ``info`` (its metadata ``meta``)."""
    route, shared, prompt, head = split_routes(meta.route)
    return SessionRecord(
        info.ref.tenant,
        info.ref.session,
        SessionState.SPILLED,
        model=meta.model,
        tokens=meta.n_tokens,
        generation=info.ref.generation,
        blob_key=meta.key,
        bytes=meta.size,
        last_used=meta.last_modified,
        route=route,
        shared=shared,
        prompt=prompt,
        head=head,
    )


async def adopt_stored(index: SessionIndex, record: SessionRecord) -> bool:
    """Record a stored generation (``index.restore_spilled``) and, when the index learned it, its
    implicit route, so that a resent history finds the session again."""
    changed = await index.restore_spilled(record)
    if changed and record.route:
        await index.add_prefixes(record.tenant, record.session, [record.route])
    return changed


async def reindex_session(store: BlobStore, index: SessionIndex, tenant: str, session: str) -> bool:
    """One session's newest stored generation recorded in ``index`` (with its implicit route), as
    :func:`reindex` records every session: what a turn does while the index heals, before it
    treats a session without a record as new. True when the index learned something."""
    info = await store.latest(tenant, session)
    if info is None:
        return False
    record = stored_record(info, await store.head(info.ref))
    changed = await adopt_stored(index, record)
    if changed:
        log.info("reindex.session", tenant=tenant, session=session, generation=record.generation)
    return changed


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slotkeeper reindex", description="Rebuild the session index from storage."
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--local", metavar="DIR", help="root directory of a local blob store")
    where.add_argument("--s3-endpoint", metavar="URL", help="S3 endpoint URL (use 'aws' for AWS's default)")
    p.add_argument("--s3-bucket", "--bucket", dest="bucket", help="S3 bucket (required with --s3-endpoint)")
    p.add_argument("--region", default="us-east-1")
    p.add_argument("--access-key", help="S3 access key (default: boto3's credential chain)")
    p.add_argument("--secret-key", help="S3 secret key (default: boto3's credential chain)")
    p.add_argument("--s3-prefix", "--prefix", dest="prefix", default="slotkeeper", help="blob key prefix")
    p.add_argument(
        "--redis-url",
        "--redis",
        dest="redis",
        required=True,
        metavar="URL",
        help="the index's Redis: redis://host:port/db, redis-cluster://host:port[,...] or "
        "redis-sentinel://host:port[,...]/MASTER (docs/operations.md)",
    )
    p.add_argument("--redis-prefix", default="slotkeeper", help="Redis key prefix")
    p.add_argument("--tenant", action="append", help="only these tenants (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="report what would change, change nothing")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


async def _run(args: argparse.Namespace) -> ReindexReport:
    from storage.blobs.localstore import LocalStore
    from storage.blobs.s3client import make_s3_client
    from storage.blobs.s3store import S3Store
    from storage.chunks.chunkstore import ChunkedStore
    from storage.chunks.ledger import ChunkLedger

    client: Any = None
    store: BlobStore
    if args.local:
        store = LocalStore(args.local, prefix=args.prefix)
    else:
        endpoint = None if args.s3_endpoint == "aws" else args.s3_endpoint
        client = make_s3_client(
            endpoint_url=endpoint, region=args.region, access_key=args.access_key, secret_key=args.secret_key
        )
        store = S3Store(client, args.bucket, prefix=args.prefix)
    redis = connect(args.redis)
    store = ChunkedStore(store, ChunkLedger(redis, prefix=args.redis_prefix))  # manifests and v1 files
    try:
        index = SessionIndex(redis, prefix=args.redis_prefix)
        return await reindex(store, index, tenants=args.tenant, dry_run=args.dry_run)
    finally:
        await store.aclose()
        await redis.aclose()
        if client is not None:
            client.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``slotkeeper reindex``; ``argv`` excludes the program name."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.s3_endpoint and not args.bucket:
        parser.error("--bucket is required with --s3-endpoint")
    try:
        report = asyncio.run(_run(args))
    except StorageError as exc:
        print(f"reindex failed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(asdict(report)))
    else:
        verb = "would restore" if args.dry_run else "restored"
        print(
            f"{report.tenants} tenants, {report.sessions} sessions: {verb} {report.restored}, "
            f"unchanged {report.unchanged}, skipped {len(report.skipped)}"
        )
    return 1 if report.skipped else 0

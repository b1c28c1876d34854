"""Blob store on any S3-compatible endpoint (AWS, MinIO, SeaweedFS, moto) through boto3.

boto3 is synchronous, so every call runs in the store's own bounded thread pool behind an async
API. Files move in parts of ``part_size`` bytes, ``concurrency`` at a time, each part read with
``pread`` (uploads, :mod:`storage.blobs.s3upload`) or written with ``pwrite`` (downloads, here) by the
thread that transfers it: memory stays near ``concurrency × part_size`` whatever the file size.
Transient failures (connection errors, timeouts, 5xx, throttling) are retried per request with
backoff (:mod:`storage.blobs.retry`); a multipart upload the server forgot is started again.

Integrity, both ends: each part is sent with its CRC-32 (``ChecksumAlgorithm="CRC32"``; servers
that check it — SeaweedFS, AWS — reject damaged parts; moto 5.2 accepts wrong ones), the
whole-object CRC-32 is stored in the object metadata as ``checksum`` and verified after every
download (the check that always works), and the part CRCs of an upload must combine to the CRC
the caller expects (``crc32=``, e.g. from the slot-file trailer) or that a first pass computed.
Downloads land in a temporary file beside the destination and are renamed only once verified.

Conditional writes: ``IfNoneMatch="*"`` on PutObject and CompleteMultipartUpload when the server
honours it (``conditional_writes="auto"`` probes once per store; moto 5.2 and SeaweedFS 4.48 both
refuse a second write). Otherwise (``"emulated"``) a head before the upload and a head after it
checking our writer id stand in. Remaining races, documented rather than hidden:

* emulated mode: two writers that both pass the first head both upload; the later one wins and
  the earlier one only gets :class:`WriteConflict` if its verifying head runs after the later write;
* moto's If-None-Match is check-then-act inside a threaded server, so concurrent completes of the
  same key can both succeed there (seen in about one run in four of the race test); SeaweedFS and
  AWS are atomic. Either way the object is always one writer's complete, verified bytes, and the
  per-session lock of :mod:`storage.index.locks` is what keeps two writers off one generation.

Errors: every public method translates botocore exceptions at its boundary
(:func:`storage.blobs.s3client.s3_errors`): configuration errors become :class:`StoreMisconfigured`
(never retried), exhausted transient ones :class:`StoreUnavailable`. :meth:`S3Store.probe` checks
the bucket, the credentials and the permissions once at start-up.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar

import structlog
from botocore.exceptions import ClientError

from storage.blobs.blobstore import BlobInfo, BlobMeta, BlobStore, ObjectInfo, PutOptions, temp_beside
from storage.blobs.metadata import decode_metadata, encode_metadata, new_writer_id
from storage.blobs.retry import RetryPolicy, retrying
from storage.blobs.s3client import (
    is_missing,
    is_precondition_failed,
    is_transient_s3,
    probe_conditional_writes,
    s3_errors,
)
from storage.blobs.s3upload import Upload
from storage.checksum import composite_crc32_b64, crc32_b64, crc32_of_parts, file_crc32
from storage.errors import ChecksumError, NotStored, StorageError, StoreMisconfigured, WriteConflict
from storage.ids import SlotRef, parse_blob_key, tenant_prefix, validate_id
from storage.probe import check_read_back

T = TypeVar("T")
P = ParamSpec("P")
log = structlog.get_logger("slotkeeper.storage")
MIN_PART = 5 << 20  # S3's minimum size of every part but the last
MAX_PARTS = 10_000
_READ_CHUNK = 1 << 20


def _boundary(
    method: Callable[Concatenate[S3Store, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[S3Store, P], Coroutine[Any, Any, T]]:
    """No botocore exception leaves this method: see :func:`storage.blobs.s3client.s3_errors`."""

    @functools.wraps(method)
    async def wrapper(self: S3Store, *args: P.args, **kwargs: P.kwargs) -> T:
        with s3_errors(method.__name__, self.bucket, self.endpoint):
            return await method(self, *args, **kwargs)

    return wrapper


class S3Store(BlobStore):
    """Slot files in ``bucket`` under ``{prefix}/{tenant}/{session}/{generation:020d}.slot``."""

    def __init__(
        self,
        client: Any,
        bucket: str,
        *,
        prefix: str = "slotkeeper",
        part_size: int = 8 << 20,
        concurrency: int = 8,
        retry: RetryPolicy | None = None,
        conditional_writes: Literal["auto", "native", "emulated"] = "auto",
        s3_checksums: bool = True,
        fsync: bool = True,
        close_client: bool = False,
    ) -> None:
        """``close_client``: :meth:`aclose` closes ``client`` too (one made for this store alone,
        :func:`storage.blobs.location.open_blob_store`); otherwise the caller owns it."""
        super().__init__(prefix)
        if part_size < MIN_PART:
            raise ValueError(f"part_size must be at least {MIN_PART} bytes (S3 minimum)")
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.client, self.bucket = client, bucket
        self.endpoint = str(getattr(getattr(client, "meta", None), "endpoint_url", "") or "")
        self.part_size, self.concurrency = part_size, concurrency
        self.retry = retry or RetryPolicy()
        self.s3_checksums, self.fsync = s3_checksums, fsync
        self._close_client = close_client
        self._native: bool | None = {"auto": None, "native": True, "emulated": False}[conditional_writes]
        self._probe_lock = asyncio.Lock()
        # +2 threads so heads and listings are not queued behind a full set of part transfers
        self._pool = ThreadPoolExecutor(max_workers=concurrency + 2, thread_name_prefix="s3store")

    async def aclose(self) -> None:
        await asyncio.to_thread(self._pool.shutdown, wait=True)
        if self._close_client:
            self.client.close()

    # ------------------------------------------------------------------------------------ plumbing
    async def thread(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in the store's bounded pool."""
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, functools.partial(fn, *args, **kwargs)
        )

    async def retried(self, op: str, fn: Callable[[], T], /, **log_context: object) -> T:
        """``fn()`` in the store's pool, retried with backoff while it fails transiently."""
        return await retrying(op, lambda: self.thread(fn), self.retry, is_transient_s3, **log_context)

    async def _s3(self, op: str, **kwargs: Any) -> Any:
        """One S3 API call in the pool, retried with backoff on transient errors."""
        method = functools.partial(getattr(self.client, op), Bucket=self.bucket, **kwargs)
        return await self.retried(op, method, key=kwargs.get("Key"))

    async def run_parts(self, jobs: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
        """Run part transfers, ``concurrency`` at a time; the first failure cancels the rest."""
        gate = asyncio.Semaphore(self.concurrency)

        async def gated(job: Callable[[], Awaitable[T]]) -> T:
            async with gate:  # the coroutine is only created once it may run
                return await job()

        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(gated(job)) for job in jobs]
        except BaseExceptionGroup as group:
            errors = [e for e in group.exceptions if not isinstance(e, asyncio.CancelledError)]
            raise (errors or list(group.exceptions))[0] from None
        return [t.result() for t in tasks]

    def ranges(self, size: int) -> list[tuple[int, int]]:
        part = max(self.part_size, -(-size // MAX_PARTS))
        return [(off, min(part, size - off)) for off in range(0, size, part)]

    # -------------------------------------------------------------------------------------- upload
    async def _put_file(self, ref: SlotRef, path: Path, opts: PutOptions) -> BlobMeta:
        with s3_errors("put_file", self.bucket, self.endpoint):  # errors name the public method
            key, crc32, started = self.key_for(ref), opts.crc32, time.monotonic()
            size = (await asyncio.to_thread(os.stat, path)).st_size
            if crc32 is None:  # metadata is fixed at create time, so the CRC is needed before the parts
                crc32 = await asyncio.to_thread(file_crc32, path)
            native = await self.native_conditional_writes()
            if await self.writer_of(ref) is not None:
                raise WriteConflict(f"generation {ref.generation} of session {ref.session} exists")
            writer = new_writer_id()
            md = encode_metadata(ref, opts, size=size, crc32=crc32, writer=writer)
            part_crcs = await Upload(self, ref, path, size, crc32, md, writer, native).run()
            meta = await self._verify_upload(ref, key, size, crc32, writer, part_crcs)
            seconds = round(time.monotonic() - started, 3)
            log.info(
                "storage.upload",
                store="s3",
                key=key,
                bytes=size,
                parts=len(part_crcs),
                seconds=seconds,
                checksum=meta.checksum,
                native_conditional=native,
            )
            return meta

    async def _verify_upload(
        self, ref: SlotRef, key: str, size: int, crc: int, writer: str, part_crcs: list[int]
    ) -> BlobMeta:
        meta, server_sum = await self._head(ref)
        if meta.writer != writer:
            raise WriteConflict(
                f"{key} holds another writer's object (emulated conditional write lost a race)"
            )
        if meta.size != size or meta.crc32 != crc:
            raise ChecksumError(
                f"{key}: stored {meta.size} bytes {meta.checksum}, sent {size} bytes", expected=crc
            )
        accepted = {crc32_b64(crc), composite_crc32_b64(part_crcs).rsplit("-", 1)[0]}
        if self.s3_checksums and server_sum and server_sum.split("-")[0] not in accepted:
            raise ChecksumError(f"{key}: server checksum {server_sum} does not match the parts sent")
        return meta

    @_boundary
    async def writer_of(self, ref: SlotRef) -> str | None:
        """The writer id of the object at ``ref`` ("" for foreign objects), None when absent."""
        try:
            return (await self._head(ref))[0].writer
        except NotStored:
            return None

    @_boundary
    async def native_conditional_writes(self) -> bool:
        """Whether the server refuses a second If-None-Match write (probed once, then cached)."""
        if self._native is None:
            async with self._probe_lock:
                if self._native is None:
                    self._native = await probe_conditional_writes(self._s3, self.prefix)
                    log.info("storage.conditional_writes", bucket=self.bucket, native=self._native)
        return self._native

    # ------------------------------------------------------------------------------------ download
    @_boundary
    async def get_to_file(self, ref: SlotRef, dest: str | Path, *, verify: bool = True) -> BlobMeta:
        started, dest = time.monotonic(), Path(dest)
        meta, _ = await self._head(ref)
        if meta.crc32 is None:
            raise ChecksumError(f"object {meta.key} has no checksum metadata")
        tmp = temp_beside(dest, new_writer_id())
        await asyncio.to_thread(_create_sized, tmp, meta.size)
        try:
            parts = await self.run_parts(
                [functools.partial(self._get_part, meta, tmp, off, n) for off, n in self.ranges(meta.size)]
            )
            crc = crc32_of_parts(parts)
            if crc != meta.crc32:
                log.warning(
                    "storage.checksum_mismatch",
                    store="s3",
                    key=meta.key,
                    expected=meta.checksum,
                    actual=f"{crc:08x}",
                )
                raise ChecksumError(
                    f"object {meta.key}: downloaded crc32 {crc:08x}, metadata says {meta.checksum}",
                    expected=meta.crc32,
                    actual=crc,
                )
            await asyncio.to_thread(_commit, tmp, dest, self.fsync)
        except BaseException:
            await asyncio.to_thread(tmp.unlink, missing_ok=True)
            raise
        log.info(
            "storage.download",
            store="s3",
            key=meta.key,
            bytes=meta.size,
            seconds=round(time.monotonic() - started, 3),
        )
        return meta

    async def _get_part(self, meta: BlobMeta, tmp: Path, offset: int, length: int) -> tuple[int, int]:
        def fetch() -> tuple[int, int]:
            cond = {"IfMatch": meta.etag} if meta.etag else {}
            resp = self.client.get_object(
                Bucket=self.bucket, Key=meta.key, Range=f"bytes={offset}-{offset + length - 1}", **cond
            )
            crc = got = 0
            with open(tmp, "r+b", buffering=0) as f:
                body = resp["Body"]
                try:
                    while got <= length and (chunk := body.read(_READ_CHUNK)):
                        crc = zlib.crc32(chunk, crc)
                        os.pwrite(f.fileno(), chunk, offset + got)
                        got += len(chunk)
                finally:
                    body.close()
            if got != length:
                raise ConnectionResetError(f"part at {offset}: got {got} of {length} bytes")
            return crc, length

        try:
            return await self.retried("get_object", fetch, key=meta.key, offset=offset)
        except ClientError as exc:
            if is_precondition_failed(exc):
                raise WriteConflict(f"{meta.key} changed during the download") from exc
            if is_missing(exc):
                raise NotStored(f"{meta.key} vanished during the download") from exc
            raise

    # ---------------------------------------------------------------------------- head, list, delete
    @_boundary
    async def head(self, ref: SlotRef) -> BlobMeta:
        return (await self._head(ref))[0]

    async def _head(self, ref: SlotRef) -> tuple[BlobMeta, str | None]:
        key = self.key_for(ref)
        try:
            resp = await self._s3("head_object", Key=key, ChecksumMode="ENABLED")
        except ClientError as exc:
            if is_missing(exc):
                raise NotStored(f"no generation {ref.generation} of session {ref.session}") from exc
            raise
        meta = decode_metadata(
            ref,
            key,
            int(resp["ContentLength"]),
            resp["LastModified"].timestamp(),
            str(resp.get("ETag", "")),
            resp.get("Metadata") or {},
        )
        return meta, resp.get("ChecksumCRC32")

    async def list(self, tenant: str, session: str | None = None) -> AsyncIterator[BlobInfo]:
        with s3_errors("list", self.bucket, self.endpoint):
            async for obj in self._list_pages(tenant_prefix(self.prefix, tenant, session)):
                ref = parse_blob_key(self.prefix, obj["Key"])
                if ref is not None and ref.tenant == tenant and session in (None, ref.session):
                    yield BlobInfo(ref, obj["Key"], int(obj["Size"]), obj["LastModified"].timestamp())

    async def list_tenants(self) -> AsyncIterator[str]:
        head = f"{self.prefix}/" if self.prefix else ""
        with s3_errors("list_tenants", self.bucket, self.endpoint):
            async for common in self._list_pages(head, delimiter="/"):
                try:
                    yield validate_id(common["Prefix"][len(head) :].rstrip("/"), "tenant id")
                except StorageError:
                    continue

    async def _list_pages(self, prefix: str, delimiter: str | None = None) -> AsyncIterator[dict[str, Any]]:
        kwargs: dict[str, Any] = {"Prefix": prefix} | ({"Delimiter": delimiter} if delimiter else {})
        while True:
            resp = await self._s3("list_objects_v2", **kwargs)
            for item in resp.get("CommonPrefixes" if delimiter else "Contents", []) or []:
                yield item
            if not resp.get("IsTruncated"):
                return
            kwargs["ContinuationToken"] = resp["NextContinuationToken"]

    @_boundary
    async def delete(self, ref: SlotRef) -> None:
        key = self.key_for(ref)
        try:
            await self._s3("delete_object", Key=key)
        except ClientError as exc:
            if not is_missing(exc):
                raise
        log.info("storage.delete", store="s3", key=key)

    # ------------------------------------------------------------------ raw objects (and documents)
    @_boundary
    async def put_object(self, key: str, data: bytes) -> None:
        # One PUT is atomic in S3: readers see the old object or the new one (documents rely on it).
        await self._s3("put_object", Key=key, Body=data, ChecksumCRC32=crc32_b64(zlib.crc32(data)))

    @_boundary
    async def get_object(self, key: str) -> bytes:
        try:
            return await self._get_bytes(key)
        except ClientError as exc:
            if is_missing(exc):
                raise NotStored(f"object {key} not found") from None
            raise

    @_boundary
    async def put_object_file(self, key: str, path: Path) -> None:
        # boto3's managed transfer: parts read from the file and sent as they are read.
        upload = functools.partial(self.client.upload_file, str(path), self.bucket, key)
        await self.retried("upload_file", upload, key=key)

    @_boundary
    async def get_object_file(self, key: str, dest: Path) -> int:
        download = functools.partial(self.client.download_file, self.bucket, key, str(dest))
        try:
            await self.retried("download_file", download, key=key)
        except ClientError as exc:
            if is_missing(exc):
                raise NotStored(f"object {key} not found") from None
            raise
        return (await asyncio.to_thread(dest.stat)).st_size

    async def _get_bytes(self, key: str) -> bytes:
        """One object's bytes: the request and its body read in one pool call (one thread hop, not
        two, for each of a restore's pieces), retried whole when either fails transiently."""

        def get() -> bytes:
            return _read_body(self.client.get_object(Bucket=self.bucket, Key=key)["Body"])

        return await self.retried("get_object", get, key=key)

    @_boundary
    async def object_size(self, key: str) -> int | None:
        try:
            head = await self._s3("head_object", Key=key)
        except ClientError as exc:
            if is_missing(exc):
                return None
            raise
        return int(head["ContentLength"])

    async def list_objects(self, key_prefix: str) -> AsyncIterator[ObjectInfo]:
        with s3_errors("list", self.bucket, self.endpoint):
            async for obj in self._list_pages(key_prefix):
                yield ObjectInfo(obj["Key"], int(obj["Size"]), obj["LastModified"].timestamp())

    @_boundary
    async def delete_object(self, key: str) -> None:
        try:
            await self._s3("delete_object", Key=key)
        except ClientError as exc:
            if not is_missing(exc):
                raise

    # --------------------------------------------------------------------------------------- probe
    @_boundary
    async def probe(self) -> None:
        """Write, list, read back (CRC verified) and delete a small object under the prefix, then
        probe conditional writes; :class:`StoreMisconfigured` names what the server refused."""
        key = f"{self.prefix}/.probe/{uuid.uuid4().hex}".lstrip("/")
        data = os.urandom(256)
        where = f"bucket {self.bucket!r} at {self.endpoint or 'AWS'}"
        await self._s3("put_object", Key=key, Body=data)
        try:
            listed = await self._s3("list_objects_v2", Prefix=key, MaxKeys=1)
            got = await self._get_bytes(key)
        finally:
            await self._s3("delete_object", Key=key)
        said = f"{where} returned other bytes than were written to {key}"
        check_read_back(data, got, said, service="s3", where=where)
        if [o.get("Key") for o in listed.get("Contents", []) or []] != [key]:
            raise StoreMisconfigured(
                f"{where} does not list the object just written ({key})",
                service="s3",
                error_code="ListMismatch",
                where=where,
            )
        native = await self.native_conditional_writes()
        log.info(
            "storage.probed",
            store="s3",
            bucket=self.bucket,
            endpoint=self.endpoint,
            native_conditional=native,
        )


def _read_body(body: Any) -> bytes:
    try:
        data = body.read()
        return data if isinstance(data, bytes) else bytes(data)  # bytes already: no second copy
    finally:
        body.close()


def _create_sized(path: Path, size: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def _commit(tmp: Path, dest: Path, fsync: bool) -> None:
    if fsync:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.replace(tmp, dest)

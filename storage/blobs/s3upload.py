"""One upload of a file to S3 for :class:`storage.blobs.s3store.S3Store` (its state: key, source, writer).

Small files go in one ``PutObject``; larger ones as a multipart upload whose parts are read with
``pread`` and sent ``concurrency`` at a time, each with its CRC-32. The part CRCs must combine to
the CRC the object metadata records, else the upload is aborted (the file changed or rotted while
it was read). A retried request can meet its own earlier success (a lost response), so a 412 or a
``NoSuchUpload`` on completion is checked against the writer id stamped into the metadata before
it counts as a conflict. An upload the server forgot (restart) is started again from scratch.
"""

from __future__ import annotations

import asyncio
import functools
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from botocore.exceptions import ClientError

from storage.blobs.s3client import is_precondition_failed, s3_error_code, s3_status
from storage.checksum import crc32_b64, crc32_of_parts
from storage.errors import ChecksumError, StorageError, StoreUnavailable, WriteConflict
from storage.ids import SlotRef

if TYPE_CHECKING:
    from storage.blobs.s3store import S3Store

log = structlog.get_logger("slotkeeper.storage")
Part = tuple[dict[str, Any], int, int]  # (CompleteMultipartUpload entry, crc32, length)


class UploadLost(Exception):
    """The server forgot the multipart upload (restarted, expired): start the upload again."""


@dataclass
class Upload:
    store: S3Store
    ref: SlotRef
    path: Path
    size: int
    crc: int
    metadata: dict[str, str]
    writer: str
    native_conditional: bool

    @property
    def key(self) -> str:
        return self.store.key_for(self.ref)

    @property
    def _cond(self) -> dict[str, str]:
        return {"IfNoneMatch": "*"} if self.native_conditional else {}

    def _sums(self, crc: int) -> dict[str, str]:
        return {"ChecksumCRC32": crc32_b64(crc)} if self.store.s3_checksums else {}

    async def run(self) -> list[int]:
        """Upload; returns the part CRCs (one for a single PUT). WriteConflict if another writer won."""
        if self.size <= self.store.part_size:
            return [await self._single()]
        return await self._multipart()

    async def _single(self) -> int:
        data = await asyncio.to_thread(self.path.read_bytes)
        if len(data) != self.size or zlib.crc32(data) != self.crc:
            raise ChecksumError(f"{self.path} does not match crc32 {self.crc:08x} / {self.size} bytes")
        try:
            await self.store._s3(
                "put_object",
                Key=self.key,
                Body=data,
                Metadata=self.metadata,
                **self._sums(self.crc),
                **self._cond,
            )
        except ClientError as exc:
            if not is_precondition_failed(exc):
                raise
            if await self.store.writer_of(self.ref) != self.writer:
                raise WriteConflict(f"{self.key} was written concurrently by another writer") from exc
        return self.crc

    async def _multipart(self) -> list[int]:
        store = self.store
        for attempt in range(store.retry.attempts):
            algo = {"ChecksumAlgorithm": "CRC32"} if store.s3_checksums else {}
            created = await store._s3("create_multipart_upload", Key=self.key, Metadata=self.metadata, **algo)
            upload_id = created["UploadId"]
            try:
                jobs = [
                    functools.partial(self._part, upload_id, i + 1, off, n)
                    for i, (off, n) in enumerate(store.ranges(self.size))
                ]
                parts = await store.run_parts(jobs)
                whole = crc32_of_parts([(c, n) for _, c, n in parts])
                if whole != self.crc:
                    message = f"{self.path} changed: parts give crc32 {whole:08x}, expected {self.crc:08x}"
                    raise ChecksumError(message, expected=self.crc, actual=whole)
                await self._complete(upload_id, [p for p, _, _ in parts])
                return [c for _, c, _ in parts]
            except UploadLost:
                log.warning("storage.upload_restarted", key=self.key, attempt=attempt + 1)
            except BaseException:
                await self._abort(upload_id)
                raise
        raise StoreUnavailable(f"upload of {self.key} lost by the server {store.retry.attempts} times")

    async def _part(self, upload_id: str, number: int, offset: int, length: int) -> Part:
        store = self.store

        def send() -> Part:  # in a pool thread: read, checksum and send one part
            with open(self.path, "rb", buffering=0) as f:
                data = os.pread(f.fileno(), length, offset)
            if len(data) != length:
                raise StorageError(f"{self.path} shrank during the upload")
            sums = self._sums(crc := zlib.crc32(data))
            try:
                resp = store.client.upload_part(
                    Bucket=store.bucket,
                    Key=self.key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=data,
                    **sums,
                )
            except ClientError as exc:
                # moto answers 500 (not NoSuchUpload) for an upload it forgot in a restart
                if s3_status(exc) >= 500 and self._gone(upload_id):
                    raise UploadLost() from exc
                raise
            return {"PartNumber": number, "ETag": resp["ETag"], **sums}, crc, length

        try:
            return await store.retried("upload_part", send, key=self.key, part=number)
        except ClientError as exc:
            if s3_error_code(exc) == "NoSuchUpload":
                raise UploadLost() from exc
            raise

    def _gone(self, upload_id: str) -> bool:
        """In a pool thread: has the server forgotten this multipart upload?"""
        try:
            self.store.client.list_parts(
                Bucket=self.store.bucket, Key=self.key, UploadId=upload_id, MaxParts=1
            )
            return False
        except ClientError as exc:
            return s3_error_code(exc) == "NoSuchUpload"
        except Exception:
            return False

    async def _complete(self, upload_id: str, parts: list[dict[str, Any]]) -> None:
        try:
            await self.store._s3(
                "complete_multipart_upload",
                Key=self.key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
                **self._cond,
            )
        except ClientError as exc:
            lost = s3_error_code(exc) == "NoSuchUpload"
            if not lost and not is_precondition_failed(exc):
                raise
            if await self.store.writer_of(self.ref) == self.writer:
                return  # our own earlier attempt succeeded; its response was lost
            if lost:
                raise UploadLost() from exc
            raise WriteConflict(f"{self.key} was written concurrently by another writer") from exc

    async def _abort(self, upload_id: str) -> None:
        try:
            await self.store.thread(
                self.store.client.abort_multipart_upload,
                Bucket=self.store.bucket,
                Key=self.key,
                UploadId=upload_id,
            )
        except Exception as exc:  # best effort: a bucket lifecycle rule reaps what is left
            log.warning("storage.abort_failed", key=self.key, error=repr(exc))

"""boto3 plumbing for the S3 store: the client factory, error classification, the probe.

Kept apart from :mod:`storage.s3store` so the store reads as the transfer logic only.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import structlog
from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError
from botocore.exceptions import ConnectionError as BotoConnectionError

log = structlog.get_logger("slotkeeper.storage")

MISSING_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
PRECONDITION_CODES = frozenset({"412", "PreconditionFailed"})
_TRANSIENT_CODES = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "SlowDown",
        "RequestTimeout",
        "RequestTimeoutException",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "ConditionalRequestConflict",  # AWS: a concurrent conditional write is in flight; retry
        "OperationAborted",
    }
)


def make_s3_client(
    *,
    endpoint_url: str | None = None,
    region: str = "us-east-1",
    access_key: str | None = None,
    secret_key: str | None = None,
    max_pool_connections: int = 16,
    connect_timeout_s: float = 5.0,
    read_timeout_s: float = 60.0,
    addressing_style: Literal["auto", "path", "virtual"] = "path",
) -> Any:
    """A boto3 S3 client configured for :class:`S3Store`; the caller owns it and closes it.

    botocore's own retries are off (the store retries with backoff and logs each retry), and
    checksums are only computed by botocore when an API requires one (the store sends its own).
    """
    import boto3
    from botocore.config import Config

    config = Config(
        max_pool_connections=max_pool_connections,
        connect_timeout=connect_timeout_s,
        read_timeout=read_timeout_s,
        retries={"total_max_attempts": 1, "mode": "standard"},
        s3={"addressing_style": addressing_style},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    session = boto3.session.Session()
    return session.client(
        "s3", endpoint_url=endpoint_url, region_name=region, aws_access_key_id=access_key,
        aws_secret_access_key=secret_key, config=config,
    )  # fmt: skip


def s3_error_code(exc: BaseException) -> str:
    """The S3 error code of a ClientError (``"404"``, ``"NoSuchKey"``...), else ``""``."""
    if isinstance(exc, ClientError):
        return str(exc.response.get("Error", {}).get("Code", ""))
    return ""


def s3_status(exc: BaseException) -> int:
    if isinstance(exc, ClientError):
        return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return 0


def is_missing(exc: BaseException) -> bool:
    return s3_error_code(exc) in MISSING_CODES or s3_status(exc) == 404


def is_precondition_failed(exc: BaseException) -> bool:
    return s3_error_code(exc) in PRECONDITION_CODES or s3_status(exc) == 412


def is_transient_s3(exc: BaseException) -> bool:
    """Connection failures, timeouts, truncated bodies, 5xx and throttling are worth retrying.

    Local file errors (``FileNotFoundError``...) are not: of ``OSError`` only the socket-level
    ``ConnectionError`` and ``TimeoutError`` count.
    """
    if isinstance(
        exc, BotoConnectionError | HTTPClientError | IncompleteReadError | ConnectionError | TimeoutError
    ):
        return True
    if isinstance(exc, ClientError):
        return s3_status(exc) >= 500 or s3_error_code(exc) in _TRANSIENT_CODES
    return False


async def _quietly(call: Awaitable[Any]) -> None:
    try:
        await call
    except Exception as exc:  # best effort: cleanup of probes and aborted uploads
        log.warning("storage.cleanup_failed", error=repr(exc))


async def probe_conditional_writes(s3: Callable[..., Awaitable[Any]], prefix: str) -> bool:
    """Does the server refuse a second If-None-Match write, for PutObject and multipart?"""
    key = f"{prefix}/.probe/{uuid.uuid4().hex}".lstrip("/")
    try:
        await s3("put_object", Key=key, Body=b"1", IfNoneMatch="*")
        try:
            await s3("put_object", Key=key, Body=b"2", IfNoneMatch="*")
            return False
        except ClientError as exc:
            if not is_precondition_failed(exc):
                return False
        upload_id = (await s3("create_multipart_upload", Key=key))["UploadId"]
        try:
            etag = (await s3("upload_part", Key=key, UploadId=upload_id, PartNumber=1, Body=b"3"))["ETag"]
            parts = {"Parts": [{"PartNumber": 1, "ETag": etag}]}
            await s3(
                "complete_multipart_upload",
                Key=key,
                UploadId=upload_id,
                MultipartUpload=parts,
                IfNoneMatch="*",
            )
            return False
        except ClientError as exc:
            await _quietly(s3("abort_multipart_upload", Key=key, UploadId=upload_id))
            return is_precondition_failed(exc)
    except ClientError as exc:
        if s3_status(exc) in (400, 501):  # the header itself is not understood
            return False
        raise
    finally:
        await _quietly(s3("delete_object", Key=key))

"""boto3 plumbing for the S3 store: the client factory, error classification, the probe.

Kept apart from :mod:`storage.blobs.s3store` so the store reads as the transfer logic only.

Errors fall in three classes (:func:`classify_s3_error`), and no botocore exception leaves
``storage/``: configuration (:data:`CONFIG_CODES`, any 301/400/401/403 without a body, and client-side
problems such as a bucket name botocore refuses or missing credentials) becomes
:class:`StoreMisconfigured` and is never retried; transient ones (:func:`is_transient_s3`) are
retried and then become :class:`StoreUnavailable`; anything else is a plain :class:`StorageError`.
A HEAD has no body, so a HEAD on a missing bucket reads as a missing object (``404``): the start-up
probe (:func:`storage.probe.probe_store`) writes first, where the server names the problem.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import structlog
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    InvalidRegionError,
    NoCredentialsError,
    NoRegionError,
    ParamValidationError,
    PartialCredentialsError,
    UnknownEndpointError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from storage.errors import StorageError, StoreMisconfigured, StoreUnavailable

log = structlog.get_logger("slotkeeper.storage")

MISSING_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
# Answers no retry can change: the bucket, the credentials, the permissions or the region are wrong.
CONFIG_CODES = frozenset(
    {
        "NoSuchBucket",
        "InvalidBucketName",
        "AccessDenied",
        "AllAccessDisabled",
        "AccountProblem",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        "InvalidSecurity",
        "NotSignedUp",
        "UnauthorizedAccess",
        "AuthorizationHeaderMalformed",
        "PermanentRedirect",
        "TemporaryRedirect",
        "Redirect",
        "IllegalLocationConstraintException",
        "RequestTimeTooSkewed",  # this host's clock, not the store
        "MissingSecurityHeader",
        "301",
        "307",
        "400",
        "401",
        "403",
    }
)
# Client-side problems botocore raises before sending anything.
_CONFIG_EXCEPTIONS = (
    ParamValidationError,
    NoCredentialsError,
    PartialCredentialsError,
    NoRegionError,
    InvalidRegionError,
    UnknownEndpointError,
)
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
    An endpoint URL or region botocore cannot use raises :class:`StoreMisconfigured`.
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
    try:
        return session.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region,
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            config=config,
        )
    except (ValueError, BotoCoreError) as exc:  # "Invalid endpoint: ...", an unknown region
        where = f"S3 endpoint {endpoint_url or 'AWS'} (region {region})"
        raise StoreMisconfigured(
            f"{where}: {exc}", service="s3", error_code=type(exc).__name__, where=where
        ) from exc


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
    """The object is absent (not the bucket: ``NoSuchBucket`` is a configuration error)."""
    code = s3_error_code(exc)
    return code != "NoSuchBucket" and (code in MISSING_CODES or s3_status(exc) == 404)


def is_config_error(exc: BaseException) -> bool:
    """An answer (or a client-side refusal) that no retry can change; see :data:`CONFIG_CODES`."""
    if isinstance(exc, _CONFIG_EXCEPTIONS):
        return True
    return isinstance(exc, ClientError) and (
        s3_error_code(exc) in CONFIG_CODES or s3_status(exc) in (301, 307, 401, 403)
    )


def classify_s3_error(exc: BaseException, *, op: str, bucket: str, endpoint: str) -> StorageError:
    """The storage error a botocore exception stands for (see the module doc)."""
    where = f"bucket {bucket!r} at {endpoint or 'AWS'}"
    if isinstance(exc, ClientError):
        code = s3_error_code(exc) or str(s3_status(exc))
        text = str(exc.response.get("Error", {}).get("Message", "") or "")
        detail = f"S3 {op} on {where}: {code} (HTTP {s3_status(exc)}){': ' + text if text else ''}"
    else:
        code = type(exc).__name__
        if isinstance(exc, ParamValidationError) and "bucket name" in str(exc).lower():
            code = "InvalidBucketName"  # botocore refused it before sending
        detail = f"S3 {op} on {where}: {code}: {exc}"
    if is_config_error(exc):
        log.error("storage.misconfigured", service="s3", op=op, bucket=bucket, endpoint=endpoint, code=code)
        return StoreMisconfigured(detail, service="s3", error_code=code, where=where)
    if is_transient_s3(exc):
        return StoreUnavailable(detail)
    return StorageError(detail)


@contextmanager
def s3_errors(op: str, bucket: str, endpoint: str) -> Iterator[None]:
    """Translate every botocore exception raised inside into a storage error."""
    try:
        yield
    except (ClientError, BotoCoreError) as exc:
        raise classify_s3_error(exc, op=op, bucket=bucket, endpoint=endpoint) from exc


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
        return not is_config_error(exc) and (s3_status(exc) >= 500 or s3_error_code(exc) in _TRANSIENT_CODES)
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

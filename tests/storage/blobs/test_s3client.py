"""storage.blobs.s3client: error classification and the client factory."""

from __future__ import annotations

from typing import Any

import pytest
from botocore.exceptions import (
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    ParamValidationError,
    ReadTimeoutError,
)

from storage.blobs.s3client import (
    classify_s3_error,
    is_config_error,
    is_missing,
    is_precondition_failed,
    is_transient_s3,
    make_s3_client,
)
from storage.errors import StorageError, StoreMisconfigured, StoreUnavailable


def client_error(code: str, status: int) -> ClientError:
    response: Any = {"Error": {"Code": code, "Message": ""}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return ClientError(response, "PutObject")


def test_classification() -> None:
    assert is_transient_s3(EndpointConnectionError(endpoint_url="http://x"))
    assert is_transient_s3(ReadTimeoutError(endpoint_url="http://x"))
    assert is_transient_s3(ConnectionResetError())
    assert is_transient_s3(client_error("InternalError", 500))
    assert is_transient_s3(client_error("SlowDown", 503))
    assert is_transient_s3(client_error("ConditionalRequestConflict", 409))
    assert not is_transient_s3(FileNotFoundError("local file"))
    assert not is_transient_s3(client_error("AccessDenied", 403))
    assert not is_transient_s3(client_error("PreconditionFailed", 412))
    assert is_precondition_failed(client_error("PreconditionFailed", 412))
    assert is_missing(client_error("NoSuchKey", 404)) and is_missing(client_error("404", 404))
    assert not is_missing(client_error("NoSuchUpload", 400))


def test_factory_configuration() -> None:
    client = make_s3_client(
        endpoint_url="http://127.0.0.1:9", access_key="a", secret_key="b", max_pool_connections=3
    )
    try:
        config = client.meta.config
        assert config.max_pool_connections == 3 and config.retries["total_max_attempts"] == 1
        assert (
            config.s3["addressing_style"] == "path" and config.request_checksum_calculation == "when_required"
        )
        assert client.meta.endpoint_url == "http://127.0.0.1:9"
    finally:
        client.close()


def test_configuration_errors_are_never_retried_and_never_escape_raw() -> None:
    where = {"op": "put_object", "bucket": "slots", "endpoint": "http://s3.test:9000"}
    table: list[tuple[BaseException, type[StorageError], str]] = [
        (client_error("NoSuchBucket", 404), StoreMisconfigured, "NoSuchBucket"),
        (client_error("InvalidBucketName", 400), StoreMisconfigured, "InvalidBucketName"),
        (client_error("AccessDenied", 403), StoreMisconfigured, "AccessDenied"),
        (client_error("InvalidAccessKeyId", 403), StoreMisconfigured, "InvalidAccessKeyId"),
        (client_error("SignatureDoesNotMatch", 403), StoreMisconfigured, "SignatureDoesNotMatch"),
        (client_error("403", 403), StoreMisconfigured, "403"),  # a HEAD: no body, no code
        (client_error("PermanentRedirect", 301), StoreMisconfigured, "PermanentRedirect"),
        (ParamValidationError(report='Invalid bucket name "a b"'), StoreMisconfigured, "InvalidBucketName"),
        (NoCredentialsError(), StoreMisconfigured, "NoCredentialsError"),
        (client_error("SlowDown", 503), StoreUnavailable, ""),
        (client_error("InternalError", 500), StoreUnavailable, ""),
        (EndpointConnectionError(endpoint_url="http://x"), StoreUnavailable, ""),
        (client_error("InvalidArgument", 400), StorageError, ""),
    ]
    for exc, kind, code in table:
        err = classify_s3_error(exc, **where)
        assert type(err) is kind, (exc, err)
        assert "'slots'" in str(err) and "http://s3.test:9000" in str(err)
        if kind is StoreMisconfigured:
            assert isinstance(err, StoreMisconfigured) and err.error_code == code and err.service == "s3"
            assert (err.status, err.code) == (500, "store_misconfigured")
            assert is_config_error(exc) and not is_transient_s3(exc)
    assert not is_missing(client_error("NoSuchBucket", 404))  # a missing bucket is not a missing object


def test_an_unusable_endpoint_is_misconfigured_at_construction() -> None:
    with pytest.raises(StoreMisconfigured, match="not a url"):
        make_s3_client(endpoint_url="not a url", access_key="a", secret_key="b")

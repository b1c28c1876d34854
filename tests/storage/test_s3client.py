"""storage.s3client: error classification and the client factory."""

from __future__ import annotations

from typing import Any

from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

from storage.s3client import is_missing, is_precondition_failed, is_transient_s3, make_s3_client


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

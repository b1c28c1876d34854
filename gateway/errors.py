"""The gateway's errors: one hierarchy with HTTP status, OpenAI `type` and `code`, rendered once.

`error_body` is the only place an error becomes `{"error": {...}}`; the app's exception handler
and the stream relay (an error after the first byte goes out as an SSE `data:` event) both use it.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse


class GatewayError(Exception):
    status = 500
    type = "server_error"
    code = "internal_error"

    def __init__(self, message: str, *, retry_after: float | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after
        self.param = param


class BadRequest(GatewayError):
    status, type, code = 400, "invalid_request_error", "invalid_request"


class Unauthorized(GatewayError):
    status, type, code = 401, "authentication_error", "invalid_api_key"


class NotFound(GatewayError):
    status, type, code = 404, "not_found_error", "not_found"


class Conflict(GatewayError):
    status, type, code = 409, "invalid_request_error", "conflict"


class QuotaExceeded(GatewayError):
    status, type, code = 429, "rate_limit_error", "quota_exceeded"


class Unavailable(GatewayError):
    """No capacity, an engine restarting or a session being restored: retry shortly."""

    status, type, code = 503, "unavailable_error", "unavailable"


class UpstreamError(GatewayError):
    status, type, code = 502, "server_error", "engine_error"


def error_body(exc: GatewayError) -> dict[str, Any]:
    return {"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}}


def error_response(exc: GatewayError) -> JSONResponse:
    headers = {}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
        headers["retry-after-ms"] = str(int(exc.retry_after * 1000))
    return JSONResponse(error_body(exc), status_code=exc.status, headers=headers)

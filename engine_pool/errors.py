"""The engine process's errors: one hierarchy carrying HTTP status and OpenAI `type`, rendered in one place.

Every failure that reaches a client leaves through `error_payload` (the `{"error": {...}}` body,
llama-server's types, `code` = the numeric status) — as a JSON response from the app's single
exception handler (`render_error`), or as the last event of a stream that had already started.
`as_engine_error` turns anything raised below (native core errors, routing errors, bugs) into one
of these classes.
"""

from __future__ import annotations

from typing import Any

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from native import errors as native_errors


class EngineError(Exception):
    """Base: an HTTP status, an OpenAI/llama-server error type and a precise message."""

    status: int = 500
    type: str = "server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        retry_after: int | None = None,
        extra: dict[str, Any] | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status
        self.message = message
        self.param = param
        self.retry_after = retry_after
        self.extra = extra or {}


class BadRequest(EngineError):
    status = 400
    type = "invalid_request_error"


class ContextSizeExceeded(BadRequest):
    """The prompt does not fit the slot's context (llama-server's exceed_context_size_error)."""

    type = "exceed_context_size_error"

    def __init__(self, n_prompt_tokens: int, n_ctx: int) -> None:
        super().__init__(
            f"the request exceeds the available context size: the prompt has {n_prompt_tokens} tokens, "
            f"a slot holds {n_ctx} (the prompt must be shorter than the slot's context)",
            extra={"n_prompt_tokens": n_prompt_tokens, "n_ctx": n_ctx},
        )


class Unauthorized(EngineError):
    status = 401
    type = "authentication_error"


class NotFound(EngineError):
    status = 404
    type = "not_found_error"


class MethodNotAllowed(EngineError):
    status = 405
    type = "invalid_request_error"


class SlotBusy(EngineError):
    """A slot operation waited its bounded time and the slot was still serving requests."""

    status = 409
    type = "slot_busy_error"


class NotSupported(EngineError):
    status = 501
    type = "not_supported_error"


class Unavailable(EngineError):
    """Loading, shutting down, or every slot busy with a full queue: retry later."""

    status = 503
    type = "unavailable_error"


class ClientGone(EngineError):
    """The client disconnected before the response; nobody reads this one (nginx's 499)."""

    status = 499
    type = "client_closed_request"


class ServerError(EngineError):
    status = 500
    type = "server_error"


_BY_STATUS: dict[int, type[EngineError]] = {
    400: BadRequest,
    401: Unauthorized,
    404: NotFound,
    405: MethodNotAllowed,
    409: SlotBusy,
    501: NotSupported,
    503: Unavailable,
}


def from_native(exc: native_errors.NativeError) -> EngineError:
    """The API error for a native core exception (the caller may add context to the message)."""
    if isinstance(exc, native_errors.SlotFileError):
        return BadRequest(f"slot file {exc.kind}: {exc}", extra={"kind": exc.kind})
    if isinstance(exc, native_errors.InvalidRequestError):
        return BadRequest(str(exc))
    if isinstance(exc, native_errors.SlotBusyError):
        return SlotBusy(str(exc))
    if isinstance(exc, native_errors.EngineClosedError):
        return Unavailable("the engine is shutting down", retry_after=1)
    return ServerError(f"engine error: {exc}")


def as_engine_error(exc: BaseException) -> EngineError:
    """Any exception as an EngineError (unexpected ones become a 500 with their type and text)."""
    if isinstance(exc, EngineError):
        return exc
    if isinstance(exc, native_errors.NativeError):
        return from_native(exc)
    if isinstance(exc, HTTPException):
        cls = _BY_STATUS.get(exc.status_code, ServerError if exc.status_code >= 500 else BadRequest)
        return cls(str(exc.detail), status=exc.status_code)
    return ServerError(f"internal error: {type(exc).__name__}: {exc}")


def error_payload(err: EngineError) -> dict[str, Any]:
    """`{"error": {message, type, param, code, ...}}` — the body of every error, streamed or not."""
    body: dict[str, Any] = {"message": err.message, "type": err.type, "param": err.param, "code": err.status}
    body.update(err.extra)
    return {"error": body}


def render_error(err: EngineError) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after)} if err.retry_after is not None else None
    return JSONResponse(error_payload(err), status_code=err.status, headers=headers)

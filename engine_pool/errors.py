"""Slotkeeper's one API error hierarchy, rendered in one place: engine, node agent and gateway.

Every failure that reaches a client leaves through `error_payload`, in the shape of the API the
client speaks (`error_style(path)`): OpenAI's `{"error": {"message", "type", "param", "code"}}`
where `code` is always a string or null (never the numeric status), plus any `extra` fields
(llama-server's `n_prompt_tokens`/`n_ctx`, a slot file's `kind`); or, on the Anthropic Messages
endpoints, Anthropic's `{"type": "error", "error": {"type", "message"}}` with the type chosen from
the status. `render_error` makes it a JSON response with `Retry-After` (and `retry-after-ms`, which
the OpenAI SDK honours) when the error says when to retry; a stream that already started sends the
same payload as its last event. `api_error` turns anything raised below — native core errors, storage
errors, Starlette's HTTP errors, bugs — into one of these classes; it is the only converter.
"""

from __future__ import annotations

from typing import Any

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from native import errors as native_errors
from storage.errors import StorageError

_UNSET: Any = object()


class ApiError(Exception):
    """Base: an HTTP status, an OpenAI/llama-server error `type`, a string `code` and a precise message.

    A subclass names what it answers with in its header (`class NotFound(ApiError, status=404, ...)`),
    inheriting what it leaves out; one error may replace any of the three where it is raised."""

    status: int = 500
    type: str = "server_error"
    code: str | None = "internal_error"

    def __init_subclass__(
        cls, *, status: int | None = None, type: str | None = None, code: str | None = _UNSET
    ) -> None:
        super().__init_subclass__()
        _answer_with(cls, status, type, code)

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        retry_after: float | None = None,
        extra: dict[str, Any] | None = None,
        status: int | None = None,
        type: str | None = None,
        code: str | None = _UNSET,
    ) -> None:
        super().__init__(message)
        _answer_with(self, status, type, code)
        self.message = message
        self.param = param
        self.retry_after = retry_after
        self.extra = extra or {}


def _answer_with(
    target: ApiError | type[ApiError], status: int | None, type: str | None, code: str | None
) -> None:
    """Set the status, type and code `target` (an error class, or one error) answers with; a None
    status or type, or an unset code, leaves that one as it is."""
    if status is not None:
        target.status = status
    if type is not None:
        target.type = type
    if code is not _UNSET:
        target.code = code


class BadRequest(ApiError, status=400, type="invalid_request_error", code="invalid_request"): ...


class ContextSizeExceeded(BadRequest, type="exceed_context_size_error", code="context_length_exceeded"):
    """The prompt does not fit the slot's context (llama-server's exceed_context_size_error)."""

    def __init__(self, n_prompt_tokens: int, n_ctx: int) -> None:
        super().__init__(
            f"the request exceeds the available context size: the prompt has {n_prompt_tokens} tokens, "
            f"a slot holds {n_ctx} (the prompt must be shorter than the slot's context)",
            extra={"n_prompt_tokens": n_prompt_tokens, "n_ctx": n_ctx},
        )


class Unauthorized(ApiError, status=401, type="authentication_error", code="invalid_api_key"): ...


class Forbidden(ApiError, status=403, type="permission_error", code="forbidden"): ...


class NotFound(ApiError, status=404, type="not_found_error", code="not_found"): ...


class MethodNotAllowed(ApiError, status=405, type="invalid_request_error", code="method_not_allowed"): ...


class RequestTimeout(ApiError, status=408, type="invalid_request_error", code="request_timeout"):
    """The client was too slow to send its request (headers or body)."""


class Conflict(ApiError, status=409, type="conflict_error", code="conflict"): ...


INSTANCE_HEADER = "x-slotkeeper-instance"  # a request's engine process: see InstanceChanged


class InstanceChanged(Conflict, code="engine_instance_changed"):
    """A request named another engine process (X-Slotkeeper-Instance) than the one answering: the
    engine restarted since its caller looked, and its slots no longer hold what the caller thinks."""


class SlotChanged(Conflict, code="slot_changed"):
    """A request or save named the session it expects its slot to hold (`slot_expect`), and the
    slot's label names another, or nobody: the slot's state is not that session's (an engine
    restarted, or a stale record placed two sessions in one slot)."""


def slot_changed(exc: BaseException) -> bool:
    """An engine (or a node passing its answer on) refused with :class:`SlotChanged`."""
    return isinstance(exc, ApiError) and exc.status == 409 and exc.code == SlotChanged.code


class SlotBusy(Conflict, type="slot_busy_error", code="slot_busy"):
    """A slot operation waited its bounded time and the slot was still serving requests."""


class PayloadTooLarge(ApiError, status=413, type="invalid_request_error", code="payload_too_large"): ...


class RateLimited(ApiError, status=429, type="rate_limit_error", code="rate_limit_exceeded"):
    """A quota or an admission limit: retry after `retry_after` seconds."""


class QuotaExceeded(RateLimited, code="quota_exceeded"): ...


class ClientGone(ApiError, status=499, type="client_closed_request", code="client_closed_request"):
    """The client disconnected before the response; nobody reads this one (nginx's 499)."""


class ServerError(ApiError, status=500, type="server_error", code="internal_error"): ...


class NotSupported(ApiError, status=501, type="not_supported_error", code="not_supported"): ...


class Upstream(ApiError, status=502, type="upstream_error", code="upstream_error"):
    """An engine, a node or the store failed in a way the caller cannot fix by changing its request."""


class PeerUnreachable(Upstream, code="peer_unreachable"):
    """A node could not connect to another node (a handoff's prefill there): the caller may reach
    both, and go through the store instead (engine_pool.pool.handoff_store)."""


class GatewayTimeout(ApiError, status=504, type="timeout_error", code="engine_timeout"):
    """An engine did not answer within the request timeout: this request fails, nothing else."""


class Unavailable(ApiError, status=503, type="unavailable_error", code="unavailable"):
    """Loading, shutting down, no capacity, or every slot busy with a full queue: retry later."""


_BY_STATUS: dict[int, type[ApiError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    405: MethodNotAllowed,
    408: RequestTimeout,
    409: Conflict,
    413: PayloadTooLarge,
    429: RateLimited,
    501: NotSupported,
    502: Upstream,
    503: Unavailable,
}


def for_status(status: int) -> type[ApiError]:
    """The class that answers `status` (unlisted 4xx: BadRequest's type; 5xx: ServerError's)."""
    return _BY_STATUS.get(status, ServerError if status >= 500 else BadRequest)


def from_native(exc: native_errors.NativeError) -> ApiError:
    """The API error for a native core exception (the caller may add context to the message)."""
    if isinstance(exc, native_errors.SlotFileError):
        return BadRequest(f"slot file {exc.kind}: {exc}", extra={"kind": exc.kind}, code="slot_file_invalid")
    if isinstance(exc, native_errors.InvalidRequestError):
        return BadRequest(str(exc))
    if isinstance(exc, native_errors.SlotBusyError):
        return SlotBusy(str(exc))
    if isinstance(exc, native_errors.EngineClosedError):
        return Unavailable("the engine is shutting down", retry_after=1)
    return ServerError(f"engine error: {exc}")


def from_storage(exc: StorageError) -> ApiError:
    """A storage error keeps its status and code; 503s (store down) say when to retry."""
    cls = for_status(exc.status)
    return cls(str(exc), status=exc.status, code=exc.code, retry_after=1 if exc.status == 503 else None)


def api_error(exc: BaseException) -> ApiError:
    """Any exception as an ApiError. Unexpected ones become a 500 naming only their type: their text
    may carry request content and is logged, never answered."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, native_errors.NativeError):
        return from_native(exc)
    if isinstance(exc, StorageError):
        return from_storage(exc)
    if isinstance(exc, HTTPException):
        return for_status(exc.status_code)(str(exc.detail), status=exc.status_code)
    return ServerError(f"internal error: {type(exc).__name__}")


def is_expected(exc: BaseException) -> bool:
    """True for errors that are answers (logged at most as warnings), False for bugs worth a traceback."""
    return isinstance(exc, ApiError | StorageError | native_errors.NativeError | HTTPException)


# Anthropic's error types by HTTP status (docs.anthropic.com "Errors"); other 4xx are invalid requests,
# other 5xx api errors. 503 (warming up, draining, no capacity) is what Anthropic calls overloaded.
_ANTHROPIC_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

_ANTHROPIC_PATHS = ("/v1/messages", "/messages")


def error_style(path: str) -> str:
    """The error shape the client of `path` parses: "anthropic" on the Messages endpoints, else "openai"."""
    for prefix in _ANTHROPIC_PATHS:
        if path == prefix or path.startswith(prefix + "/"):
            return "anthropic"
    return "openai"


def anthropic_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_payload(err: ApiError, style: str = "openai") -> dict[str, Any]:
    """The body of every error, streamed or not: `{"error": {message, type, param, code, ...}}`, or
    Anthropic's `{"type": "error", "error": {type, message, ...}}` (extras kept in both)."""
    if style not in ("openai", "anthropic"):
        raise ValueError(f"unknown error style {style!r}")
    if style == "anthropic":
        return {
            "type": "error",
            "error": {"type": anthropic_type(err.status), "message": err.message, **err.extra},
        }
    body: dict[str, Any] = {"message": err.message, "type": err.type, "param": err.param, "code": err.code}
    body.update(err.extra)
    return {"error": body}


def retry_headers(retry_after: float | None) -> dict[str, str]:
    if retry_after is None:
        return {}
    return {"Retry-After": str(max(1, round(retry_after))), "retry-after-ms": str(int(retry_after * 1000))}


def render_error(err: ApiError, style: str = "openai") -> JSONResponse:
    return JSONResponse(
        error_payload(err, style), status_code=err.status, headers=retry_headers(err.retry_after)
    )

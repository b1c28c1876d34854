"""The one error hierarchy of ``storage/``.

Every error carries an HTTP ``status`` and a machine ``code`` so that the gateway can render it in
its single error handler without knowing storage internals. Slot-file problems are
:class:`SlotFileError` with a ``kind`` from SLOTFILE.md's list; everything else is a small subclass
named after what went wrong.
"""

from __future__ import annotations

from typing import ClassVar

SLOT_FILE_ERROR_KINDS: tuple[str, ...] = (
    "truncated",
    "bad_magic",
    "unsupported_version",
    "checksum_mismatch",
    "bad_layout",
    "model_mismatch",
    "shape_mismatch",
    "too_large",
)


class StorageError(Exception):
    """Base of every error raised by ``storage/``."""

    status: ClassVar[int] = 500
    code: ClassVar[str] = "storage_error"


class SlotFileError(StorageError):
    """A slot file failed validation; ``kind`` is one of :data:`SLOT_FILE_ERROR_KINDS`."""

    status = 422
    code = "slot_file_invalid"

    def __init__(self, kind: str, message: str, *, offset: int | None = None) -> None:
        if kind not in SLOT_FILE_ERROR_KINDS:
            raise ValueError(f"unknown slot file error kind {kind!r}")
        self.kind = kind
        self.offset = offset
        where = f" (at byte {offset})" if offset is not None else ""
        super().__init__(f"{kind}: {message}{where}")


class ChecksumError(StorageError):
    """Bytes moved between tiers do not match the checksum recorded for them."""

    status = 502
    code = "checksum_mismatch"

    def __init__(self, message: str, *, expected: int | None = None, actual: int | None = None) -> None:
        self.expected = expected
        self.actual = actual
        super().__init__(message)


class NotStored(StorageError):
    """Nothing is stored under that name (for this tenant): no such object, document, session record
    or cached generation. Named apart from the API error ``NotFound``, which the gateway and the
    node raise about a request."""

    status = 404
    code = "not_found"


class WriteConflict(StorageError):
    """A conditional write lost: the generation already exists, or a record changed under us. Named
    apart from the API error ``Conflict``: this one is always about stored state."""

    status = 409
    code = "conflict"


class GenerationUsed(WriteConflict):
    """The generation was used by an earlier, deleted session with the same id (at or below the
    record's floor): save as ``SessionRecord.next_generation`` or later."""


class IllegalTransition(StorageError):
    """A decision produced a session record that storage.index.records.TRANSITIONS does not allow
    after the one it read: a bug in the decision, never a runtime condition."""

    code = "illegal_transition"


class InvalidId(StorageError, ValueError):
    """A tenant, session, engine or other id that could address a path or another namespace."""

    status = 400
    code = "invalid_id"

    def __init__(self, what: str, reason: str) -> None:
        self.what = what
        self.reason = reason
        super().__init__(f"invalid {what}: {reason}")


class StoreUnavailable(StorageError):
    """The blob store or Redis could not be reached (after retries)."""

    status = 503
    code = "store_unavailable"


class StoreMisconfigured(StorageError):
    """The blob store or Redis answers, but refuses us for a reason no retry fixes: a missing or
    invalid bucket, wrong credentials, no permission, a read-only replica.

    Raised by the start-up probes (:mod:`storage.probe`) and wherever S3 or Redis answers with
    such an error later. ``service`` is ``"s3"``, ``"local"`` or ``"redis"``; ``error_code`` is the
    server's code (``NoSuchBucket``, ``InvalidBucketName``, ``AccessDenied``, ``InvalidAccessKeyId``,
    ``SignatureDoesNotMatch``, ``NOPERM``...) or the client library's exception name; ``where`` names
    the bucket and endpoint (or directory, or Redis address).
    """

    status = 500
    code = "store_misconfigured"

    def __init__(self, message: str, *, service: str = "", error_code: str = "", where: str = "") -> None:
        self.service = service
        self.error_code = error_code
        self.where = where
        super().__init__(message)


class LockBusy(StorageError):
    """The session lock is held by another owner."""

    status = 409
    code = "session_busy"


class LockLost(StorageError):
    """The caller no longer owns the lock it presented (expired and maybe taken over)."""

    status = 409
    code = "lock_lost"

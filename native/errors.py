"""Exceptions raised by the native core (translated from C++ in native/src/bindings.cpp).

Pure Python, importable without loading libllama.
"""


class NativeError(Exception):
    """Base of every error the native core raises."""


class ModelLoadError(NativeError):
    """The model file could not be loaded, or no context could be created for it."""


class InvalidRequestError(NativeError):
    """Bad arguments: unknown slot, empty or oversized prompt, token outside the vocabulary, grammar."""


class SlotBusyError(NativeError):
    """The slot is serving a request; save, restore and erase need it idle."""


class EngineClosedError(NativeError):
    """The engine was closed, or its loop faulted (the message then says why); nothing more can be
    queued."""


class SlotFileError(NativeError):
    """A slot file is unreadable, damaged, foreign or too large; the slot was left empty.

    `kind` is one of: io, truncated, bad_magic, unsupported_version, checksum_mismatch, bad_layout,
    model_mismatch, shape_mismatch, too_large (see native/SLOTFILE.md).
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (type(self), (self.kind, str(self)))

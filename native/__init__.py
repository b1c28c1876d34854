"""Slotkeeper's native core: llama.cpp slots that persist and resume hybrid sessions exactly.

`import llama_cpp` comes first on purpose: it loads site-packages/llama_cpp/lib/libllama.so, and the
extension (RUNPATH $ORIGIN/../llama_cpp/lib) then resolves to that same copy, so exactly one
libllama (one ggml backend registry) lives in the process, wherever the extension file lands.
"""

import llama_cpp  # noqa: F401  (see above)

from .loading import explain_missing_module

try:
    from . import _native  # noqa: F401
except ImportError as exc:  # one line that names the cause: the engine's supervisor reports it
    raise ImportError(explain_missing_module(__file__, exc)) from exc

from ._native import (
    ENGINE_VERSION,
    KV_CACHE_TYPES,
    LLAMA_BUILD,
    MAX_N_PROBS,
    STATE_SEQ_VERSION,
    ChatLayer,
    ChatParser,
    EngineConfig,
    Event,
    ModelInfo,
    RequestParams,
    SlotFileInfo,
    SlotInfo,
    SlotSnapshot,
    Timings,
    checkpoints_to_evict,
    crc32,
    read_fingerprint,
)
from .engine import Completion, Engine
from .errors import (
    EngineClosedError,
    InvalidRequestError,
    ModelLoadError,
    NativeError,
    SlotBusyError,
    SlotFileError,
)

__all__ = [
    "ENGINE_VERSION",
    "KV_CACHE_TYPES",
    "LLAMA_BUILD",
    "MAX_N_PROBS",
    "STATE_SEQ_VERSION",
    "ChatLayer",
    "ChatParser",
    "Completion",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "Event",
    "InvalidRequestError",
    "ModelInfo",
    "ModelLoadError",
    "NativeError",
    "RequestParams",
    "SlotBusyError",
    "SlotFileError",
    "SlotFileInfo",
    "SlotInfo",
    "SlotSnapshot",
    "Timings",
    "checkpoints_to_evict",
    "crc32",
    "read_fingerprint",
]

// Typed errors of the native core. bindings.cpp translates each to the Python class of the same
// name in native/errors.py; nothing else crosses the boundary.
#pragma once

#include <stdexcept>
#include <string>

namespace sk {

struct NativeError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// The model file could not be loaded or a context could not be created.
struct ModelLoadError : NativeError {
    using NativeError::NativeError;
};

// A request or call with bad arguments (slot id, empty prompt, prompt past the context, grammar).
struct InvalidRequestError : NativeError {
    using NativeError::NativeError;
};

// The slot is serving a request; save/restore/erase need it idle.
struct SlotBusyError : NativeError {
    using NativeError::NativeError;
};

// The engine was closed (or its loop died); nothing more can be queued.
struct EngineClosedError : NativeError {
    using NativeError::NativeError;
};

// A slot file is unreadable, damaged, foreign or too large. `kind` is one of the kinds listed in
// native/SLOTFILE.md; the slot involved is left empty and the engine keeps serving.
struct SlotFileError : NativeError {
    std::string kind;
    SlotFileError(std::string kind_, const std::string & msg) : NativeError(msg), kind(std::move(kind_)) {}
};

}  // namespace sk

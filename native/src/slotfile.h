// Slot file format v1 (native/SLOTFILE.md): writing a slot's image and reading one back with every
// length bounds-checked against the bytes that are really there before anything is allocated.
#pragma once

#include <llama.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model.h"
#include "seqstate.h"

namespace sk {

enum class CheckpointKind : uint8_t { PromptEnd = 0, Hint = 1, Interval = 2 };
const char * checkpoint_kind_name(CheckpointKind k);
CheckpointKind checkpoint_kind_from_name(const std::string & s);

// A checkpoint's bytes: filled when it is made, never changed after, and shared by every copy of
// the checkpoint — a save's snapshot holds a slot's checkpoints (hundreds of MB) without copying
// them. Resizing or assigning gives this copy a buffer of its own; the others keep theirs.
template <class T>
class SharedBuffer {
public:
    const T * data() const { return v_ ? v_->data() : nullptr; }
    T * data() { return v_ ? v_->data() : nullptr; }  // to fill it right after resize, not shared yet
    size_t size() const { return v_ ? v_->size() : 0; }
    bool empty() const { return size() == 0; }
    void resize(size_t n) { v_ = std::make_shared<std::vector<T>>(n); }
    template <class It>
    void assign(It first, It last) {
        v_ = std::make_shared<std::vector<T>>(first, last);
    }
    SharedBuffer & operator=(std::vector<T> && v) {
        v_ = std::make_shared<std::vector<T>>(std::move(v));
        return *this;
    }

private:
    std::shared_ptr<std::vector<T>> v_;
};

// A copy of a sequence's partial state after its first n_tokens tokens, with the logits of the
// last of them. Attention-only models keep an empty state (their KV is trimmed instead).
struct Checkpoint {
    int64_t n_tokens = 0;
    int32_t pos_min = -1;
    int32_t pos_max = -1;
    SharedBuffer<uint8_t> state;  // llama_state_seq_get_data_ext(PARTIAL_ONLY), with its 8-byte prefix
    SharedBuffer<float> logits;   // n_vocab floats, or empty
    CheckpointKind kind = CheckpointKind::Interval;

    size_t bytes() const { return state.size() + logits.size() * sizeof(float); }
};

// What identifies the writer; checked against the reader before any state is loaded.
struct SlotFileMeta {
    ModelIdentity model;
    int n_ctx = 0;
    int n_slots = 0;
    int n_ctx_slot = 0;
    bool swa_full = false;
    bool flash_attn = false;  // changes the V cache layout (transposed without it)
    std::string type_k = "f16";  // KV cache types (-ctk/-ctv names)
    std::string type_v = "f16";
    int source_slot = -1;
};

// Writes `path` atomically (temp file + rename). `memory_state` is the memory's part of
// llama_state_seq_get_data's output (after its 8-byte in-memory prefix, which the base payload
// drops as save_file does), in the one-stream form (seqstate.h), in pieces written one after the
// other. `durable`: fsync before the rename (a file that only carries a handoff on one node skips
// it; its checksums are written all the same). Returns the file size. Throws
// SlotFileError("io", ...) on write failure.
uint64_t write_slot_file(const std::string & path, const SlotFileMeta & meta, const std::vector<llama_token> & tokens,
                         const std::vector<ByteSpan> & memory_state, const std::vector<float> & last_logits,
                         const std::vector<Checkpoint> & checkpoints, bool durable = true);

// The bytes of a slot file being read: the file mapped privately (its pages come from the page
// cache, populated at once; a write changes this process's copy of that page only), or, where a
// mapping cannot be made, a buffer it was read into. Mapping instead of reading spares a copy and,
// above all, fresh memory: on a VM, the first-touch faults of a fresh buffer cost more than reading
// the file into it (figures: docs/benchmarks.md). Safe to map: slot
// files are written to a temporary name and renamed into place (write_slot_file), never rewritten
// where they lie, and a mapping outlives an unlink; an image lives only while it is restored.
class FileBytes {
public:
    static FileBytes map_or_read(int fd, uint64_t size, const std::string & path);
    ~FileBytes();
    FileBytes(FileBytes && o) noexcept;
    FileBytes & operator=(FileBytes && o) noexcept;
    FileBytes(const FileBytes &) = delete;
    FileBytes & operator=(const FileBytes &) = delete;
    FileBytes() = default;

    uint8_t * data() { return data_; }
    const uint8_t * data() const { return data_; }
    size_t size() const { return size_; }
    bool mapped() const { return mapped_; }

private:
    uint8_t * data_ = nullptr;
    size_t size_ = 0;
    bool mapped_ = false;
    std::vector<uint8_t> copy_;  // when not mapped
};

// A validated file held in memory (`bytes`, the whole file); the base state is handed to
// llama_state_seq_set_data with its 8-byte prefix written in place over the 8 bytes before it
// (the state header and tokens, already copied out).
struct SlotImage {
    std::vector<llama_token> tokens;
    FileBytes bytes;
    size_t state_offset = 0;  // in bytes, where the prefixed state starts
    size_t state_size = 0;    // prefixed size
    std::vector<float> last_logits;
    std::vector<Checkpoint> checkpoints;
    std::string fingerprint;
    uint64_t file_size = 0;

    const uint8_t * state_data() const { return bytes.data() + state_offset; }
    uint8_t * state_data() { return bytes.data() + state_offset; }
};

struct ReadLimits {
    std::string fingerprint;   // must match
    int n_vocab = 0;           // logits records must have exactly this many floats
    int n_ctx_slot = 0;        // max tokens
    uint64_t max_file_bytes = 0;  // 0 = no limit
    size_t max_checkpoints = 0;   // keep at most this many (newest); 0 = drop all
    std::string type_k;           // KV cache types the file must record ("" = not checked)
    std::string type_v;
};

// Throws SlotFileError with the kind of the first problem found.
SlotImage read_slot_file(const std::string & path, const ReadLimits & limits);

}  // namespace sk

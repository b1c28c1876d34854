// The stream layout of a llama.cpp sequence state (llama_state_seq_get_data), and its one-stream
// form, the form slot files hold.
//
// With per-slot KV streams (cparams.kv_unified = false) an attention cache writes a sequence's
// state as its stream count N, then for every stream a cell count and, where it is not 0, the
// cells: only the sequence's own stream (stream `seq`) is not empty. Restoring reads stream by
// stream and places each non-empty one in the destination sequence's stream, whatever its index.
// So the one-stream form (1, the cells) and the N-stream form carry the same cells; going between
// them is dropping or adding empty streams' zero counts: in front of the cells on the way in
// (restore), on both sides of them on the way out (save). Only the memory layout this knows is
// converted: a plain hybrid memory, one attention cache followed by the recurrent state (whose
// size is the state's partial size), or one attention cache alone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace sk {

struct ByteSpan {
    const uint8_t * data = nullptr;
    size_t size = 0;
};

// Where the one attention cache lies in a state as llama_state_seq_get_data returns it (with its
// 8-byte prefix): its stream count at offset 8, its last byte `tail` bytes before the end.
struct StreamLayout {
    uint32_t n_stream = 1;
    uint32_t stream = 0;  // the sequence's own
    size_t tail = 0;      // bytes after the attention cache (the recurrent state), 0 if none
};

// The memory's state (what follows the 8-byte prefix) in the one-stream form, as views into
// `state`. Throws NativeError if the state is not laid out as `layout` says (a stream count other
// than N, an empty stream that is not empty).
std::vector<ByteSpan> one_stream_parts(const std::vector<uint8_t> & state, const StreamLayout & layout);

// `prefix_room` bytes before `state` (a one-stream state with its 8-byte prefix, `size` bytes)
// may be overwritten: the N-stream state for llama_state_seq_set_data is written in place in
// front of it where they suffice (returned as a view into the caller's bytes; the prefix and
// stream count in front of the cells are overwritten), else into `copy`. An empty view if `state`
// is not in the one-stream form.
ByteSpan to_streams(uint8_t * state, size_t size, size_t prefix_room, uint32_t n_stream, std::vector<uint8_t> & copy);

}  // namespace sk

#include "seqstate.h"

#include <cstring>
#include <string>

#include "errors.h"

namespace sk {

namespace {

uint32_t u32_at(const uint8_t * p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

bool all_zero(const uint8_t * p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (p[i] != 0) return false;
    }
    return true;
}

}  // namespace

std::vector<ByteSpan> one_stream_parts(const std::vector<uint8_t> & state, const StreamLayout & layout) {
    const uint8_t * p = state.data();
    const size_t n = state.size();
    if (n < 8) throw NativeError("sequence state shorter than its prefix");
    if (layout.n_stream <= 1) return {{p + 8, n - 8}};
    const size_t before = 4 * size_t(layout.stream);                       // empty streams before ours
    const size_t after = 4 * size_t(layout.n_stream - 1 - layout.stream);  // and after it
    auto bad = [&](const std::string & why) {
        return NativeError("the KV state of sequence " + std::to_string(layout.stream) + " is not laid out in " +
                           std::to_string(layout.n_stream) + " streams as expected (" + why + ")");
    };
    if (layout.stream >= layout.n_stream) throw bad("no such stream");
    if (n < 8 + 4 + before + 4 + after + layout.tail) throw bad("shorter than its stream counts");
    if (u32_at(p + 8) != layout.n_stream) throw bad("stream count " + std::to_string(u32_at(p + 8)));
    if (!all_zero(p + 12, before)) throw bad("a stream before it is not empty");
    const size_t cache_end = n - layout.tail;
    if (!all_zero(p + cache_end - after, after)) throw bad("a stream after it is not empty");
    // Stream count 1, our stream's cells (its count first), whatever follows the cache.
    static const uint32_t kOne = 1;
    std::vector<ByteSpan> out;
    out.push_back({reinterpret_cast<const uint8_t *>(&kOne), 4});
    out.push_back({p + 12 + before, cache_end - after - (12 + before)});
    if (layout.tail > 0) out.push_back({p + cache_end, layout.tail});
    return out;
}

ByteSpan to_streams(uint8_t * state, size_t size, size_t prefix_room, uint32_t n_stream, std::vector<uint8_t> & copy) {
    if (size < 16 || u32_at(state + 8) != 1) return {};
    if (n_stream <= 1) return {state, size};
    const size_t extra = 4 * size_t(n_stream - 1);
    // prefix (8) + n_stream (4) + the empty streams' counts, then the saved state from its first
    // stream's cell count on.
    uint8_t head[12];
    std::memcpy(head, state, 8);
    std::memcpy(head + 8, &n_stream, 4);
    if (prefix_room >= extra) {
        uint8_t * start = state - extra;
        std::memcpy(start, head, 12);
        std::memset(start + 12, 0, extra);
        return {start, size + extra};
    }
    copy.assign(size + extra, 0);
    std::memcpy(copy.data(), head, 12);
    std::memcpy(copy.data() + 12 + extra, state + 12, size - 12);
    return {copy.data(), copy.size()};
}

}  // namespace sk

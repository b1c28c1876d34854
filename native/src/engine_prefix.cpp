// Starting a request from another slot's state: its prompt shares a prefix (a system prompt and
// tools, a parent conversation) with what another slot holds. Loop thread only, like the rest of
// the decode loop; which slots a request may start from is the caller's to say
// (RequestParams::prefix_sources), never this engine's.
#include "engine_state.h"

#include <new>

namespace sk {

int Engine::prefix_source(const Slot & s, const RequestParams & p, int own_keep, Timings & report) const {
    std::vector<SourceCandidate> candidates;
    for (int id : p.prefix_sources) {
        if (id < 0 || id >= cfg_.n_slots || id == s.id) continue;
        const Slot & o = slots_[size_t(id)];
        if (o.tokens.empty() || o.owner != p.owner) continue;  // never another owner's state
        const int common = int(common_prefix(o.tokens, p.prompt));
        // The same rule as for the request's own slot: what the other slot's memory and
        // checkpoints could serve of this prompt, were it the request's slot (never more than the
        // common prefix: a slot that cannot win is not planned, nor its tokens copied for it).
        const int keep = common >= own_keep + kMinCopyGain ? plan_reuse(memory_view(o), p.prompt, true).n_keep : 0;
        candidates.push_back({id, keep, common});
        if (common > report.common_n) describe_candidate(o, common, report);
    }
    const int chosen = choose_prefix_source(own_keep, candidates);
    for (const auto & c : candidates) {
        if (c.slot == chosen) describe_candidate(slots_[size_t(chosen)], c.common, report);
    }
    return chosen;
}

void Engine::describe_candidate(const Slot & o, int common, Timings & report) const {
    report.candidate_slot = o.id;
    report.candidate_n = int(o.tokens.size());
    report.candidate_prompt_n = o.prompt_n;
    report.common_n = common;
}

bool Engine::copy_slot(const Slot & from, Slot & to) {
    clear_slot_memory(to);
    llama_memory_t mem = llama_get_memory(ctx_.get());
    bool ok = true;
    if (!kv_streams_) {
        // One KV stream: the cells gain the target sequence and nothing is copied; a recurrent
        // cell is shared until the target's next decode or checkpoint rollback gives it its own.
        llama_memory_seq_cp(mem, from.id, to.id, -1, -1);
        ok = own_window(to);
    } else {
        // A stream per slot: llama.cpp copies across streams only whole buffers, at the next
        // decode; a copy through the sequence state is complete when it returns (a save of the
        // target before that decode must not read a buffer still waiting for its copy).
        // llama.cpp reads a one-sequence state into the target's own stream.
        std::vector<uint8_t> state;
        const size_t size = llama_state_seq_get_size(ctx_.get(), from.id);
        try {
            state.resize(size);
        } catch (const std::bad_alloc &) {
            ok = false;
        }
        ok = ok && size >= 8 && llama_state_seq_get_data(ctx_.get(), state.data(), size, from.id) == size &&
             llama_state_seq_set_data(ctx_.get(), state.data(), size, to.id) == size;
    }
    if (!ok || llama_memory_seq_pos_max(mem, to.id) != llama_pos(from.tokens.size()) - 1) {
        clear_slot_memory(to);
        bump("prefix_copy_failures");
        return false;
    }
    to.tokens = from.tokens;
    to.last_logits = from.last_logits;
    to.checkpoints = from.checkpoints;  // shared buffers, immutable once captured
    to.prompt_n = from.prompt_n;
    to.owner = from.owner;
    bump("prefix_copies");
    return true;
}

bool Engine::own_window(const Slot & s) {
    // A sliding-window cache keeps the cells that left the window until it needs them, and then
    // reuses only a cell that ONE sequence holds (llama.cpp's find_slot). Cells seq_cp shares
    // between the source and the copy are never reused: once a prompt of the window cache's size
    // or more filled it (n_swa * n_slots + n_ubatch cells), the copy's next llama_decode — and the
    // source's — found no cell and failed with code 1 (a second handoff of one prompt on gemma2).
    // The copy takes its own window instead: a sequence's partial state holds only its unmasked
    // cells (the window, plus a recurrent state on a hybrid), and reading it back drops the copy
    // from the shared cells first, which then belong to the source alone. The full-attention
    // cells stay shared: that cache is sized for every slot's context.
    if (model().n_swa <= 0 || cfg_.swa_full) return true;
    constexpr auto kPartial = LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY;
    const size_t size = llama_state_seq_get_size_ext(ctx_.get(), s.id, kPartial);
    std::vector<uint8_t> window;
    try {
        window.resize(size);
    } catch (const std::bad_alloc &) {
        return false;
    }
    return size >= 8 && llama_state_seq_get_data_ext(ctx_.get(), window.data(), size, s.id, kPartial) == size &&
           llama_state_seq_set_data_ext(ctx_.get(), window.data(), size, s.id, kPartial) == size;
}

}  // namespace sk

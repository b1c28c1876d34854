// The shared KV pool of an engine (--kv-unified) and context shift: how a slot's cells are given
// back when the pool or its context is full. Loop thread only, like the rest of the decode loop.
#include "engine_state.h"

#include <algorithm>

namespace sk {

// llama-server's context shift (update_slots): keep the first n_keep tokens (plus the BOS), drop
// n_discard of the rest (default half), move what follows down. Only for memories that can drop a
// range and shift positions (attention; checked at start). The slot's tokens stay exactly the
// sequence's (positions 0..n-1); checkpoints past the kept prefix and the last logits no longer
// describe any prefix of it and go. False (nothing changed) when nothing can be dropped.
bool Engine::shift_context(Slot & s) {
    Active & a = *s.active;
    const int n = int(s.tokens.size());
    int keep = a.params.n_keep < 0 ? int(a.params.prompt.size()) : a.params.n_keep;
    if (a.params.n_keep >= 0 && model().add_bos) keep += 1;
    keep = std::max(0, std::min(keep, n_ctx_slot_ - 4));
    const int left = n - keep;
    const int discard = std::min(left, a.params.n_discard > 0 ? a.params.n_discard : left / 2);
    if (discard <= 0) return false;
    llama_memory_t mem = llama_get_memory(ctx_.get());
    if (!llama_memory_seq_rm(mem, s.id, keep, keep + discard)) {
        bump("context_shift_failures");
        return false;
    }
    llama_memory_seq_add(mem, s.id, keep + discard, n, -discard);
    s.tokens.erase(s.tokens.begin() + keep, s.tokens.begin() + keep + discard);
    s.last_logits.clear();  // the next decode (the pending token) sets them again
    auto & ck = s.checkpoints;
    ck.erase(std::remove_if(ck.begin(), ck.end(), [&](const Checkpoint & c) { return c.n_tokens > keep; }), ck.end());
    a.timings.context_shifts++;
    bump("context_shifts");
    bump("context_shift_tokens_discarded", discard);
    return true;
}

size_t Engine::cells_held(const Slot & s) const {
    // An attention (or hybrid) sequence holds one KV cell per token; a recurrent one holds one
    // state cell whatever its length, outside the n_ctx pool.
    return model().recurrent ? 0 : s.tokens.size();
}

// Free the least recently used idle slot's cells (its cached session is only a cache). Slots with
// a request waiting for them go last. False when no idle slot holds any.
bool Engine::evict_idle_slot(int except_slot) {
    Slot * best = nullptr;
    bool best_wanted = true;
    for (auto & s : slots_) {
        if (s.id == except_slot || s.active || cells_held(s) == 0) continue;
        const bool wanted = slot_busy(s);
        if (!best || (best_wanted && !wanted) || (wanted == best_wanted && s.last_used < best->last_used)) {
            best = &s;
            best_wanted = wanted;
        }
    }
    if (!best) return false;
    bump("kv_pool_evictions");
    bump("kv_pool_evicted_tokens", int64_t(best->tokens.size()));
    clear_slot_memory(*best);
    return true;
}

// The shared pool (kv_unified) could not hold the batch. First idle slots give their cells back;
// when none holds any, one request gives way: the largest prompt still being evaluated fails ("no
// room"; it is the newest demand, and a generation already under way keeps what it has), else the
// longest generation shifts its context (with --context-shift) or stops as if it had reached its
// context ("context"); its cells then go back with the idle slots' on the next try.
void Engine::make_room_in_pool() {
    if (evict_idle_slot(-1)) return;
    Slot * victim = nullptr;
    auto rank = [](const Slot & s) {  // prompts first, then by the cells they need
        const Active & a = *s.active;
        return std::make_pair(a.generating ? 0 : 1, a.generating ? s.tokens.size() : a.params.prompt.size());
    };
    for (auto & s : slots_) {
        if (s.active && (!victim || rank(s) > rank(*victim))) victim = &s;
    }
    if (!victim) return;
    if (!victim->active->generating) {
        bump("kv_pool_requests_failed");
        fail_slot(*victim, "the KV cache is full: all " + std::to_string(n_ctx_) +
                               " cells of the pool the slots share (--kv-unified) are held by other requests");
    } else if (!(cfg_.context_shift && shift_context(*victim))) {
        bump("kv_pool_requests_stopped");
        finish(*victim, "context");
    }
}

}  // namespace sk

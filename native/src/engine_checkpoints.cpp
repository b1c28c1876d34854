// A slot's checkpoints: captured while a prompt is evaluated (at planned positions, with the
// logits there) and kept within the slot's budget of count and bytes. Loop thread only, like the
// rest of the decode loop.
#include "engine_state.h"

#include <algorithm>
#include <new>

namespace sk {

void Engine::capture_checkpoint(Slot & s, CheckpointKind kind, const float * logits) {
    if (fault_at_checkpoint_.exchange(false)) throw std::bad_alloc();  // inject_fault_for_tests
    // A checkpoint's logits serve only a prompt that ends exactly there (nothing left to evaluate):
    // a prompt's end. A hint or interval checkpoint sits inside prompts, so a later prompt goes on
    // past it and evaluates at least one token, whose logits are fresh; the planner skips a
    // checkpoint without logits for a prompt ending on it (plan_reuse), so leaving them out is
    // exact. On a 256k vocabulary they are 1 MiB a checkpoint. An attention-only checkpoint holds
    // no state, only its logits: without them it is not worth keeping.
    const bool keeps_logits = kind == CheckpointKind::PromptEnd;
    if (!keeps_logits && !model().has_partial_state()) return;
    Checkpoint c;
    c.n_tokens = int64_t(s.tokens.size());
    c.kind = kind;
    llama_memory_t mem = llama_get_memory(ctx_.get());
    c.pos_min = llama_memory_seq_pos_min(mem, s.id);
    c.pos_max = llama_memory_seq_pos_max(mem, s.id);
    if (model().has_partial_state()) {
        const size_t size = llama_state_seq_get_size_ext(ctx_.get(), s.id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
        c.state.resize(size);
        if (size == 0 || llama_state_seq_get_data_ext(ctx_.get(), c.state.data(), size, s.id,
                                                      LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) != size) {
            bump("checkpoint_capture_failures");
            return;
        }
    }
    if (keeps_logits) c.logits.assign(logits, logits + n_vocab_);
    s.checkpoints.push_back(std::move(c));
    std::sort(s.checkpoints.begin(), s.checkpoints.end(),
              [](const Checkpoint & x, const Checkpoint & y) { return x.n_tokens < y.n_tokens; });
    if (s.active) s.active->timings.checkpoints_created++;
    bump("checkpoints_created");
    enforce_checkpoint_budget(s);
}

void Engine::enforce_checkpoint_budget(Slot & s) {
    std::vector<CheckpointBudgetItem> items;
    for (const auto & c : s.checkpoints) items.push_back({c.n_tokens, c.kind, c.bytes()});
    const auto drop = checkpoints_to_evict(items, size_t(cfg_.max_checkpoints), size_t(cfg_.max_checkpoint_bytes));
    for (auto it = drop.rbegin(); it != drop.rend(); ++it) s.checkpoints.erase(s.checkpoints.begin() + long(*it));
    if (!drop.empty()) bump("checkpoints_evicted", int64_t(drop.size()));
}

// What a slot file keeps of a slot's ladder: the same choice under the stored budget. The slot
// keeps its own ladder whole; the checkpoints are shared buffers, so this copies no state.
std::vector<Checkpoint> Engine::stored_ladder(const std::vector<Checkpoint> & ladder) {
    std::vector<CheckpointBudgetItem> items;
    for (const auto & c : ladder) items.push_back({c.n_tokens, c.kind, c.bytes()});
    const auto drop =
        checkpoints_to_evict(items, size_t(cfg_.max_stored_checkpoints), size_t(cfg_.max_stored_checkpoint_bytes));
    std::vector<Checkpoint> out;
    out.reserve(ladder.size() - drop.size());
    size_t d = 0;
    for (size_t i = 0; i < ladder.size(); i++) {
        if (d < drop.size() && drop[d] == i) {
            d++;
            continue;
        }
        out.push_back(ladder[i]);
    }
    if (!drop.empty()) bump("checkpoints_not_stored", int64_t(drop.size()));
    return out;
}

}  // namespace sk

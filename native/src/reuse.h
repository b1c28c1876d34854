// Pure decisions of the engine loop: how much of a slot's state a new prompt can reuse, where to
// place checkpoints, which checkpoints to drop, which slot serves a request. Plain data in, plain
// data out; the loop in engine.cpp only carries the decisions out.
#pragma once

#include "slotfile.h"

#include <llama.h>

#include <cstdint>
#include <string>
#include <vector>

namespace sk {

struct CheckpointView {
    int64_t n_tokens = 0;
    bool has_logits = false;
    bool has_state = false;
};

// What the loop knows of a slot when a request starts on it.
struct MemoryView {
    std::vector<llama_token> tokens;  // tokens in the sequence (positions 0..n-1)
    bool has_last_logits = false;     // logits of position n-1 are stored
    llama_pos pos_min = -1;           // llama_memory_seq_pos_min, -1 when empty
    bool recurrent = false;           // recurrent or hybrid memory: no partial trimming
    int n_swa = 0;                    // SWA window; 0 when none (or swa_full)
    std::vector<CheckpointView> checkpoints;  // ascending n_tokens
};

enum class ReuseKind { None, Live, Checkpoint, Logits };
const char * reuse_kind_name(ReuseKind k);

struct ReusePlan {
    ReuseKind kind = ReuseKind::None;
    int n_keep = 0;          // prompt tokens served without evaluation
    int checkpoint = -1;     // checkpoint index to roll back to, -1 = none
    bool clear = false;      // drop the whole sequence first
    bool trim = false;       // seq_rm(n_keep, -1) (after the rollback, if any)
    bool logits_from_checkpoint = false;  // n_keep == prompt size: sample from the checkpoint's logits
    bool logits_from_slot = false;        // n_keep == prompt size: sample from the slot's last logits
    int64_t keep_checkpoints_upto = 0;    // checkpoints past this many tokens no longer match the prompt
};

size_t common_prefix(const std::vector<llama_token> & a, const std::vector<llama_token> & b);

ReusePlan plan_reuse(const MemoryView & m, const std::vector<llama_token> & prompt, bool cache_prompt);

// A slot the request may start from instead of its own, and what it would reuse there.
struct SourceCandidate {
    int slot;
    int n_keep;   // prompt tokens it would serve
    int common;   // its common prefix with the prompt
};

// Copying another slot's state costs a copy of its memory, so it is worth it only when that slot
// serves at least this many prompt tokens more than the request's own slot.
constexpr int kMinCopyGain = 32;

// The candidate serving the most prompt tokens, when it serves at least kMinCopyGain more than
// `own_keep` (the request's own slot); -1 otherwise. Ties go to the first listed.
int choose_prefix_source(int own_keep, const std::vector<SourceCandidate> & candidates);

struct PlannedCheckpoint {
    int64_t n_tokens;
    CheckpointKind kind;
};

// A hint at most this many tokens before the prompt end replaces the prompt end's checkpoint.
constexpr int64_t kPromptEndSlack = 8;

// Checkpoints to capture while evaluating prompt tokens [start, n_prompt): the prompt end (unless a
// hint within kPromptEndSlack before it stands for it), the hinted message boundaries, every
// `interval` tokens. Intervals closer than `min_step` to a stronger planned or existing checkpoint
// are skipped, and so are hints less than `min_step` after one (but the hint standing for the prompt
// end). Ascending.
std::vector<PlannedCheckpoint> plan_checkpoints(int64_t start, int64_t n_prompt, const std::vector<int> & hints,
                                                int interval, int min_step, const std::vector<int64_t> & existing);

struct CheckpointBudgetItem {
    int64_t n_tokens;
    CheckpointKind kind;
    size_t bytes;
};

// Tokens added to a checkpoint's distance from the newest before its logarithm is taken: below
// this, closer checkpoints are all "near the end" and a rollback costs little whichever is kept.
constexpr double kLadderScale = 64.0;
// What a message boundary (a prompt end, a hint) is worth over an interval checkpoint, in the
// log2 gap its removal would leave: an interval is dropped first unless it fills a gap that much
// (2^0.5 ≈ 1.4 times) wider.
constexpr double kBoundaryBonus = 0.5;

// Indices (into `items`, ascending n_tokens) to drop so that at most max_count checkpoints of at
// most max_bytes in total remain: the ladder that keeps a rollback cheap wherever a later prompt
// leaves the state. The newest checkpoint (where the next turn goes on) goes last, and the oldest
// message boundary (the conversation's opening: the end of a system prompt and tools that other
// sessions share) before it. Each other drop takes the checkpoint whose neighbours lie closest in
// log2(distance from the newest + kLadderScale) — position 0, a whole prefill, being the left end —
// so what remains is spaced geometrically toward the end: a prompt that leaves the state D tokens
// before the newest checkpoint re-evaluates about D tokens at most, however long the session.
// Message boundaries weigh kBoundaryBonus more; ties go to the older one.
std::vector<size_t> checkpoints_to_evict(const std::vector<CheckpointBudgetItem> & items, size_t max_count,
                                         size_t max_bytes);

struct SlotCandidate {
    int id;
    bool idle;
    size_t common_prefix;  // with the request's prompt
    double last_used;
};

// The idle slot with the longest common prefix of at least `min_prefix` tokens (a shared BOS or
// template header is no reason to evict another session), else the least recently used idle slot;
// -1 if none is idle.
int choose_slot(const std::vector<SlotCandidate> & slots, size_t min_prefix);

}  // namespace sk

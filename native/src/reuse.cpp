#include "reuse.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace sk {

const char * reuse_kind_name(ReuseKind k) {
    switch (k) {
        case ReuseKind::None: return "none";
        case ReuseKind::Live: return "live";
        case ReuseKind::Checkpoint: return "checkpoint";
        case ReuseKind::Logits: return "logits";
    }
    return "none";
}

size_t common_prefix(const std::vector<llama_token> & a, const std::vector<llama_token> & b) {
    const size_t n = std::min(a.size(), b.size());
    size_t i = 0;
    while (i < n && a[i] == b[i]) i++;
    return i;
}

ReusePlan plan_reuse(const MemoryView & m, const std::vector<llama_token> & prompt, bool cache_prompt) {
    ReusePlan none;
    const int n = int(m.tokens.size());
    const int L = int(prompt.size());
    none.clear = n > 0;
    if (!cache_prompt || n == 0 || L == 0) return none;

    const int p = int(common_prefix(m.tokens, prompt));
    ReusePlan best = none;
    best.keep_checkpoints_upto = p;

    // 1. The memory as it is, continued from its exact end (every memory kind can do this).
    if (p == n) {
        if (L > n) {
            ReusePlan r;
            r.kind = ReuseKind::Live;
            r.n_keep = n;
            r.keep_checkpoints_upto = p;
            best = r;
        } else if (m.has_last_logits) {  // L == n: identical prompt, nothing to evaluate
            ReusePlan r;
            r.kind = ReuseKind::Logits;
            r.n_keep = n;
            r.logits_from_slot = true;
            r.keep_checkpoints_upto = p;
            return r;
        }
    }

    // 2. Trimming the memory back to the common prefix: attention KV only; SWA only while the
    //    window that the next token attends to is still in the cache.
    if (!m.recurrent && p > 0) {
        int r = std::min(p, L);
        if (r == L) r = L - 1;  // need the logits of position L-1: evaluate it (unless a checkpoint has them)
        const bool window_ok = m.n_swa <= 0 || m.pos_min <= std::max(0, r - m.n_swa);
        if (r > best.n_keep && window_ok && r > 0) {
            ReusePlan t;
            t.kind = ReuseKind::Live;
            t.n_keep = r;
            t.trim = r < n;
            t.keep_checkpoints_upto = p;
            best = t;
        }
    }

    // 3. Rolling back to the newest checkpoint inside the common prefix. A checkpoint at exactly the
    //    prompt's end serves it from its logits with nothing evaluated.
    for (int i = int(m.checkpoints.size()) - 1; i >= 0; i--) {
        const CheckpointView & c = m.checkpoints[size_t(i)];
        if (c.n_tokens > p || c.n_tokens > L || c.n_tokens <= 0) continue;
        if (c.n_tokens == L && !c.has_logits) continue;
        if (!c.has_state && m.recurrent) continue;
        // Attention-only checkpoints hold no state: they are a trim plus their logits, valid when
        // trimming is (SWA: the window must still be there).
        if (!c.has_state && m.n_swa > 0 && m.pos_min > std::max<int64_t>(0, c.n_tokens - m.n_swa)) continue;
        if (c.n_tokens > best.n_keep) {
            ReusePlan r;
            r.n_keep = int(c.n_tokens);
            r.checkpoint = c.has_state ? i : -1;
            r.trim = c.n_tokens < n;
            r.keep_checkpoints_upto = p;
            if (c.n_tokens == L) {
                r.kind = ReuseKind::Logits;
                r.logits_from_checkpoint = true;
                r.checkpoint = i;  // the logits come from it even when it holds no state
            } else {
                r.kind = c.has_state ? ReuseKind::Checkpoint : ReuseKind::Live;
            }
            best = r;
        }
        break;  // the newest usable one is the longest
    }

    if (best.kind == ReuseKind::None) {
        best.clear = true;
        best.n_keep = 0;
    } else {
        best.clear = false;
    }
    return best;
}

std::vector<PlannedCheckpoint> plan_checkpoints(int64_t start, int64_t n_prompt, const std::vector<int> & hints,
                                                int interval, int min_step, const std::vector<int64_t> & existing) {
    std::vector<PlannedCheckpoint> out;
    if (n_prompt <= start) return out;
    // Whether an existing or already planned checkpoint at position p satisfies `at(p)`.
    auto any_checkpoint = [&](auto at) {
        for (int64_t e : existing) {
            if (at(e)) return true;
        }
        for (const auto & c : out) {
            if (at(c.n_tokens)) return true;
        }
        return false;
    };
    auto taken = [&](int64_t q) { return any_checkpoint([&](int64_t p) { return p == q; }); };
    auto near = [&](int64_t q) {
        return any_checkpoint([&](int64_t p) { return std::llabs(p - q) < min_step || p == q; });
    };
    // Another checkpoint less than min_step before q.
    auto just_after = [&](int64_t q) { return any_checkpoint([&](int64_t p) { return p < q && q - p < min_step; }); };
    // Strongest first, so weaker ones yield to them.
    bool have_end = false;
    for (int64_t e : existing) have_end |= e == n_prompt;
    // A hint a few tokens before the prompt end (where the next turn, re-rendered without the
    // reasoning its generation prompt opened, leaves this prompt) stands for the prompt end too:
    // an identical retry evaluates those few tokens from it, and each turn keeps one recurrent
    // state fewer — in the slot, in its files and in what a save writes.
    for (int h : hints) {
        bool kept = h > start || std::find(existing.begin(), existing.end(), int64_t(h)) != existing.end();
        have_end |= kept && h < n_prompt && n_prompt - h <= kPromptEndSlack;
    }
    if (!have_end) out.push_back({n_prompt, CheckpointKind::PromptEnd});
    std::vector<int> hs(hints.begin(), hints.end());
    std::sort(hs.begin(), hs.end());
    for (int h : hs) {
        if (h <= start || h >= n_prompt || taken(h)) continue;
        // The hint where the next turn leaves this prompt is kept however close to the others (a
        // history rewrite lands two tokens before the prompt end, right after the last turn's own).
        // Any other hint (the start of the last user message) less than min_step after a checkpoint
        // yields to it: a request diverging there evaluates those few tokens more, and a short
        // reply between two turns costs no recurrent state of its own.
        if (n_prompt - h > kPromptEndSlack && just_after(h)) continue;
        out.push_back({h, CheckpointKind::Hint});
    }
    if (interval > 0) {
        for (int64_t q = (start / interval + 1) * interval; q < n_prompt; q += interval) {
            if (!near(q)) out.push_back({q, CheckpointKind::Interval});
        }
    }
    std::sort(out.begin(), out.end(), [](const auto & a, const auto & b) { return a.n_tokens < b.n_tokens; });
    return out;
}

std::vector<size_t> checkpoints_to_evict(const std::vector<CheckpointBudgetItem> & items, size_t max_count,
                                         size_t max_bytes) {
    std::vector<size_t> drop;
    if (items.empty()) return drop;
    size_t bytes = 0;
    for (const auto & it : items) bytes += it.bytes;
    std::vector<size_t> kept(items.size());
    std::iota(kept.begin(), kept.end(), 0);
    auto over = [&] { return kept.size() > max_count || bytes > max_bytes; };
    auto remove = [&](size_t k) {
        bytes -= items[kept[k]].bytes;
        drop.push_back(kept[k]);
        kept.erase(kept.begin() + long(k));
    };
    const size_t newest = items.size() - 1;
    size_t opening = newest;  // the oldest message boundary
    for (size_t i = 0; i < items.size(); i++) {
        if (items[i].kind != CheckpointKind::Interval) {
            opening = i;
            break;
        }
    }
    const double end = double(items[newest].n_tokens);
    // Position 0 (an empty state: a whole prefill) is the ladder's fixed left end.
    auto u = [&](double n_tokens) { return std::log2(end - n_tokens + kLadderScale); };
    for (;;) {
        if (!over()) break;
        size_t best = kept.size();
        double best_cost = 0.0;
        for (size_t k = 0; k + 1 < kept.size(); k++) {
            const size_t i = kept[k];
            if (i == opening) continue;
            const double left = k == 0 ? u(0.0) : u(double(items[kept[k - 1]].n_tokens));
            double cost = left - u(double(items[kept[k + 1]].n_tokens));
            if (items[i].kind != CheckpointKind::Interval) cost += kBoundaryBonus;
            if (best == kept.size() || cost < best_cost) {
                best = k;
                best_cost = cost;
            }
        }
        if (best == kept.size()) break;  // only the pinned ones are left
        remove(best);
    }
    while (over() && !kept.empty()) remove(0);  // the opening, then the newest
    std::sort(drop.begin(), drop.end());
    return drop;
}

int choose_prefix_source(int own_keep, const std::vector<SourceCandidate> & candidates) {
    int best = -1;
    int keep = own_keep;
    for (const auto & c : candidates) {
        if (c.n_keep > keep) {
            keep = c.n_keep;
            best = c.slot;
        }
    }
    return best >= 0 && keep - own_keep >= kMinCopyGain ? best : -1;
}

int choose_slot(const std::vector<SlotCandidate> & slots, size_t min_prefix) {
    auto prefix = [&](const SlotCandidate & s) { return s.common_prefix >= min_prefix ? s.common_prefix : 0; };
    int best = -1;
    for (size_t i = 0; i < slots.size(); i++) {
        const auto & s = slots[i];
        if (!s.idle) continue;
        if (best < 0) {
            best = int(i);
            continue;
        }
        const auto & b = slots[size_t(best)];
        if (prefix(s) > prefix(b) || (prefix(s) == prefix(b) && s.last_used < b.last_used)) {
            best = int(i);
        }
    }
    return best < 0 ? -1 : slots[size_t(best)].id;
}

}  // namespace sk

// Slot operations called from other threads (save, restore, erase, listing): each runs its part
// that touches the context on the loop thread through `call`, and its file work on the caller's;
// and the loop thread's own views and changes of a slot's state (busy, memory view, clearing).
#include "engine_state.h"

#include "slotfile.h"

#include <algorithm>
#include <cstring>
#include <new>

namespace sk {

SlotFileInfo Engine::save_slot(int slot, const std::string & path) {
    return write_snapshot(*snapshot_slot(slot), path);
}

std::shared_ptr<SlotSnapshot> Engine::snapshot_slot(int slot) {
    check_slot_id(slot);
    const double t0 = now_s();
    // Copy the state on the loop thread (memory speed); the file is written on another.
    return call<std::shared_ptr<SlotSnapshot>>([this, slot, t0] {
        Slot & s = slots_[size_t(slot)];
        if (slot_busy(s)) throw SlotBusyError("slot " + std::to_string(slot) + " is processing a request");
        auto snap = std::make_shared<SlotSnapshot>();
        SlotSnapshot & out = *snap;
        out.slot = slot;
        out.t0 = t0;
        const size_t size = llama_state_seq_get_size(ctx_.get(), slot);
        try {
            out.tokens = s.tokens;
            out.state.resize(size);
            out.logits = s.last_logits;
            out.checkpoints = stored_ladder(s.checkpoints);
        } catch (const std::bad_alloc &) {
            // The one big allocation a command makes (the state, possibly GBs; checkpoints are
            // shared, not copied). Only copies were being made, so the engine is intact: the save
            // fails, not it.
            throw NativeError("not enough memory to copy the state of slot " + std::to_string(slot) + " (" +
                              std::to_string(size) + " bytes)");
        }
        if (size < 8 || llama_state_seq_get_data(ctx_.get(), out.state.data(), size, slot) != size) {
            throw NativeError("llama.cpp could not copy the state of slot " + std::to_string(slot));
        }
        if (kv_streams_) {
            // The recurrent state follows the attention cache: its size is the partial state's.
            const size_t partial = llama_state_seq_get_size_ext(ctx_.get(), slot, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
            if (partial < 8 || partial - 8 >= size - 8) {
                throw NativeError("llama.cpp gave slot " + std::to_string(slot) + " a partial state that does not fit its state");
            }
            out.layout = StreamLayout{uint32_t(cfg_.n_slots), uint32_t(slot), partial - 8};
        }
        return snap;
    });
}

SlotFileInfo Engine::write_snapshot(const SlotSnapshot & snap, const std::string & path, bool durable) {
    const int slot = snap.slot;
    check_slot_id(slot);
    SlotFileMeta meta;
    meta.model = model();  // its ModelIdentity part
    meta.n_ctx = n_ctx_;
    meta.n_slots = cfg_.n_slots;
    meta.n_ctx_slot = n_ctx_slot_;
    meta.swa_full = cfg_.swa_full;
    meta.flash_attn = cfg_.flash_attn;
    meta.type_k = cfg_.cache_type_k;
    meta.type_v = cfg_.cache_type_v;
    meta.source_slot = slot;
    SlotFileInfo info;
    info.path = path;
    info.n_tokens = int(snap.tokens.size());
    info.n_checkpoints = int(snap.checkpoints.size());
    info.n_bytes = write_slot_file(path, meta, snap.tokens, one_stream_parts(snap.state, snap.layout), snap.logits,
                                   snap.checkpoints, durable);
    info.ms = ms_since(snap.t0);
    bump("slot_saves");
    bump("slot_save_bytes", int64_t(info.n_bytes));
    return info;
}

SlotFileInfo Engine::restore_slot(int slot, const std::string & path) {
    check_slot_id(slot);
    const double t0 = now_s();
    // Read and validate on this thread; only the state load runs on the loop.
    ReadLimits lim;
    lim.fingerprint = model().fingerprint;
    lim.n_vocab = n_vocab_;
    lim.n_ctx_slot = n_ctx_slot_ - 1;
    lim.max_file_bytes = cfg_.max_slot_file_bytes;
    lim.max_checkpoints = size_t(cfg_.max_checkpoints);
    lim.type_k = cfg_.cache_type_k;
    lim.type_v = cfg_.cache_type_v;
    std::shared_ptr<SlotImage> img;
    try {
        img = std::make_shared<SlotImage>(read_slot_file(path, lim));
        for (const auto & c : img->checkpoints) {
            if (model().needs_checkpoints_to_trim() && c.state.empty()) {
                throw SlotFileError("bad_layout", "a checkpoint of a recurrent/hybrid model holds no state");
            }
        }
    } catch (const SlotFileError &) {
        // The caller meant to replace the slot's session: never leave the old one in its place.
        bump("slot_restore_errors");
        call<int>([this, slot] {
            Slot & s = slots_[size_t(slot)];
            if (!slot_busy(s)) clear_slot_memory(s);
            return 0;
        });
        throw;
    }
    SlotFileInfo info = call<SlotFileInfo>([this, slot, img, path] {
        Slot & s = slots_[size_t(slot)];
        if (slot_busy(s)) throw SlotBusyError("slot " + std::to_string(slot) + " is processing a request");
        clear_slot_memory(s);
        if (cfg_.kv_unified && !model().recurrent) {
            // The slots share the pool: idle sessions give their cells back until the file fits.
            const size_t need = img->tokens.size();
            for (;;) {
                size_t held = 0;
                for (const auto & o : slots_) held += cells_held(o);
                if (held + need <= size_t(n_ctx_)) break;
                if (!evict_idle_slot(slot)) {
                    bump("slot_restore_errors");
                    throw SlotFileError("too_large", "the slot file holds " + std::to_string(need) + " tokens and the KV "
                                        "pool the slots share (--kv-unified) has " + std::to_string(size_t(n_ctx_) - held) +
                                        " of " + std::to_string(n_ctx_) + " cells free (the rest serve requests); the slot "
                                        "was left empty");
                }
            }
        }
        if (!img->tokens.empty()) {
            std::vector<uint8_t> copy;  // where the file's bytes leave no room for the empty streams
            const ByteSpan state = kv_streams_ ? to_streams(img->state_data(), img->state_size, img->state_offset,
                                                            uint32_t(cfg_.n_slots), copy)
                                               : ByteSpan{img->state_data(), img->state_size};
            const size_t n = state.data ? llama_state_seq_set_data(ctx_.get(), state.data, state.size, slot) : 0;
            const llama_pos pos_max = llama_memory_seq_pos_max(llama_get_memory(ctx_.get()), slot);
            if (!state.data || n != state.size || pos_max != llama_pos(img->tokens.size()) - 1) {
                clear_slot_memory(s);
                bump("slot_restore_errors");
                throw SlotFileError("shape_mismatch", "llama.cpp refused the saved sequence state (another context "
                                                      "shape, KV type or memory layout); the slot was left empty");
            }
        }
        s.tokens = img->tokens;
        s.last_logits = std::move(img->last_logits);
        s.checkpoints = std::move(img->checkpoints);
        s.restored = true;
        enforce_checkpoint_budget(s);
        SlotFileInfo out;
        out.path = path;
        out.n_tokens = int(s.tokens.size());
        out.n_bytes = img->file_size;
        out.n_checkpoints = int(s.checkpoints.size());
        return out;
    });
    info.ms = ms_since(t0);
    bump("slot_restores");
    bump("slot_restore_bytes", int64_t(info.n_bytes));
    return info;
}

int Engine::erase_slot(int slot) {
    check_slot_id(slot);
    return call<int>([this, slot] {
        Slot & s = slots_[size_t(slot)];
        if (slot_busy(s)) throw SlotBusyError("slot " + std::to_string(slot) + " is processing a request");
        const int n = int(s.tokens.size());
        clear_slot_memory(s);
        return n;
    });
}

std::vector<SlotInfo> Engine::slots() {
    return call<std::vector<SlotInfo>>([this] {
        std::vector<SlotInfo> out;
        for (const auto & s : slots_) {
            SlotInfo i;
            i.id = s.id;
            i.busy = bool(s.active);
            i.request_id = s.active ? s.active->id : -1;
            for (const auto & q : queued_) i.queued += q.slot == s.id ? 1 : 0;
            i.n_tokens = int(s.tokens.size());
            i.n_checkpoints = int(s.checkpoints.size());
            for (const auto & c : s.checkpoints) i.checkpoint_bytes += c.bytes();
            i.restored = s.restored;
            i.last_used = s.last_used;
            out.push_back(i);
        }
        return out;
    });
}

std::vector<llama_token> Engine::slot_tokens(int slot) {
    check_slot_id(slot);
    return call<std::vector<llama_token>>([this, slot] { return slots_[size_t(slot)].tokens; });
}

// --- loop thread ---
bool Engine::slot_busy(const Slot & s) const {
    // A request queued for the slot claims it as much as a running one: a save, restore or erase
    // issued after it must not slip in before it starts.
    return s.active || std::any_of(queued_.begin(), queued_.end(), [&](const Queued & q) { return q.slot == s.id; });
}

MemoryView Engine::memory_view(const Slot & s) const {
    MemoryView m;
    m.tokens = s.tokens;
    m.has_last_logits = !s.last_logits.empty();
    m.pos_min = llama_memory_seq_pos_min(llama_get_memory(ctx_.get()), s.id);
    m.recurrent = model().needs_checkpoints_to_trim();
    m.n_swa = cfg_.swa_full ? 0 : model().n_swa;
    for (const auto & c : s.checkpoints) m.checkpoints.push_back({c.n_tokens, !c.logits.empty(), !c.state.empty()});
    return m;
}

void Engine::clear_slot_memory(Slot & s) {
    llama_memory_seq_rm(llama_get_memory(ctx_.get()), s.id, -1, -1);
    s.tokens.clear();
    s.last_logits.clear();
    s.checkpoints.clear();
    s.restored = false;
    s.prompt_n = 0;
    s.owner.clear();
}

}  // namespace sk

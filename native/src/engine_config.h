// An engine's configuration (llama-server's flags for one model and its slots), fixed when the
// engine is built, and what can be checked of it before the model loads.
#pragma once

#include "model.h"

#include <llama.h>

#include <cstdint>
#include <string>
#include <vector>

namespace sk {

struct EngineConfig {
    ModelLoad model;
    int n_slots = 1;
    int n_ctx = 4096;
    int n_batch = 512;
    int n_ubatch = 512;
    int n_threads = 0;
    int checkpoint_interval = 2048;
    int checkpoint_min_step = 64;
    int max_checkpoints = 32;
    uint64_t max_checkpoint_bytes = uint64_t(1) << 30;
    // The ladder a slot file keeps (saves, snapshots): at most this many checkpoints of at most
    // this many bytes, chosen by checkpoints_to_evict from the slot's own (which stays whole).
    int max_stored_checkpoints = 8;
    uint64_t max_stored_checkpoint_bytes = uint64_t(512) << 20;
    uint64_t max_slot_file_bytes = 0;
    bool swa_full = false;
    bool flash_attn = false;
    // llama-server's --kv-unified: every slot may grow into the whole KV pool (n_ctx cells shared
    // by all slots) instead of n_ctx / n_slots. The llama_context has one unified stream either
    // way; this only changes each slot's limit and what happens when the shared cells run out.
    bool kv_unified = false;
    // -ctk / -ctv: KV cache data types (f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1). A
    // quantized V cache needs flash attention. Recorded in slot files: a file restores only into
    // an engine with the same types.
    std::string cache_type_k = "f16";
    std::string cache_type_v = "f16";
    bool warmup = true;  // one throwaway decode at start, as llama-server does (--no-warmup)
    // --context-shift: a generating slot that reaches its context drops the older half of what
    // follows its request's n_keep tokens and goes on (attention-only models; refused at start for
    // recurrent/hybrid models and wherever llama.cpp cannot shift the KV cache).
    bool context_shift = false;
};

// Everything that can be refused without the model, checked before it loads (which takes seconds
// to minutes). Returns `cfg`; throws InvalidRequestError.
const EngineConfig & checked_config(const EngineConfig & cfg);

// The KV cache types llama-server's -ctk/-ctv accept, by name. Throws InvalidRequestError naming
// `flag` for any other name.
ggml_type kv_cache_type(const std::string & name, const char * flag);
const std::vector<std::string> & kv_cache_type_names();

}  // namespace sk

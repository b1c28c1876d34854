#include "engine_config.h"

#include "errors.h"

namespace sk {

namespace {

struct KvTypeName {
    const char * name;
    ggml_type type;
};

// llama-server's allowed -ctk/-ctv values (common/arg.cpp kv_cache_types), in its order.
constexpr KvTypeName kKvTypes[] = {
    {"f32", GGML_TYPE_F32},   {"f16", GGML_TYPE_F16},   {"bf16", GGML_TYPE_BF16},
    {"q8_0", GGML_TYPE_Q8_0}, {"q4_0", GGML_TYPE_Q4_0}, {"q4_1", GGML_TYPE_Q4_1},
    {"iq4_nl", GGML_TYPE_IQ4_NL}, {"q5_0", GGML_TYPE_Q5_0}, {"q5_1", GGML_TYPE_Q5_1},
};

bool is_quantized(ggml_type t) { return t != GGML_TYPE_F32 && t != GGML_TYPE_F16 && t != GGML_TYPE_BF16; }

}  // namespace

const std::vector<std::string> & kv_cache_type_names() {
    static const std::vector<std::string> names = [] {
        std::vector<std::string> out;
        for (const auto & t : kKvTypes) out.emplace_back(t.name);
        return out;
    }();
    return names;
}

ggml_type kv_cache_type(const std::string & name, const char * flag) {
    for (const auto & t : kKvTypes) {
        if (name == t.name) return t.type;
    }
    std::string allowed;
    for (const auto & t : kKvTypes) allowed += std::string(allowed.empty() ? "" : ", ") + t.name;
    throw InvalidRequestError(std::string(flag) + ": unknown KV cache type '" + name + "' (allowed: " + allowed + ")");
}

const EngineConfig & checked_config(const EngineConfig & cfg) {
    if (cfg.n_slots < 1 || cfg.n_slots > 256) throw InvalidRequestError("n_slots must be within 1..256");
    if (cfg.n_ctx < 16 * cfg.n_slots) throw InvalidRequestError("n_ctx must give every slot at least 16 tokens");
    if (cfg.n_batch < 1 || cfg.n_ubatch < 1) throw InvalidRequestError("n_batch and n_ubatch must be positive");
    if (cfg.max_checkpoints < 0) throw InvalidRequestError("max_checkpoints must be >= 0");
    if (cfg.max_stored_checkpoints < 0) throw InvalidRequestError("max_stored_checkpoints must be >= 0");
    kv_cache_type(cfg.cache_type_k, "--cache-type-k");
    const ggml_type v = kv_cache_type(cfg.cache_type_v, "--cache-type-v");
    if (is_quantized(v) && !cfg.flash_attn) {
        // llama_init_from_model refuses it too ("V cache quantization requires flash_attn"), after
        // the model has loaded and with only a log line to say why.
        throw InvalidRequestError("--cache-type-v " + cfg.cache_type_v +
                                  " needs flash attention (-fa on): llama.cpp quantizes the V cache only "
                                  "with flash attention");
    }
    return cfg;
}

}  // namespace sk

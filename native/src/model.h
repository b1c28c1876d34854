// A loaded GGUF model (RAII over llama_model) and what the rest of the system needs to know of it.
#pragma once

#include <llama.h>

#include <functional>
#include <map>
#include <memory>
#include <string>

namespace sk {

// How to load a GGUF: llama-server's -m, -ngl, --no-repack, --no-mmap and --mlock.
struct ModelLoad {
    std::string path;
    int n_gpu_layers = 0;
    // llama.cpp's extra weight buffer types (CPU repacking, AMX). llama-server's --no-repack turns
    // them off; on CPUs with AMX, multi-token batches over quantized weights crash in the AMX
    // kernels (llama.cpp #20824), so the engine process turns them off there.
    bool repack = true;
    bool use_mmap = true;    // --no-mmap turns it off (read the weights into memory)
    bool use_mlock = false;  // --mlock: keep the weights resident
};

// What a sequence state depends on: the model (its fingerprint) and the shape of its memory. Every
// slot file records it (slotfile.h), so that a foreign file is named as such before it is loaded.
struct ModelIdentity {
    std::string fingerprint;
    std::string arch;
    int n_vocab = 0;
    int n_embd = 0;
    int n_layer = 0;
    bool recurrent = false;
    bool hybrid = false;
    int n_swa = 0;
};

struct ModelInfo : ModelIdentity {
    std::string path;
    std::string description;
    int n_ctx_train = 0;
    uint64_t n_params = 0;
    uint64_t size_bytes = 0;
    std::string chat_template;
    llama_token bos = -1;
    llama_token eos = -1;
    llama_token eot = -1;
    bool add_bos = false;
    std::map<std::string, std::string> meta;

    // Recurrent or hybrid memory: a sequence cannot be trimmed, only continued or rolled back.
    bool needs_checkpoints_to_trim() const { return recurrent || hybrid; }
    // Whether partial states (checkpoints) carry anything: recurrent, hybrid or SWA.
    bool has_partial_state() const { return recurrent || hybrid || n_swa > 0; }
};

struct ModelDeleter {
    void operator()(llama_model * m) const { llama_model_free(m); }
};
using ModelPtr = std::unique_ptr<llama_model, ModelDeleter>;

// Told the fraction of the weights loaded so far, at most once per tenth and once at the end.
// Called on the loading thread; what it throws is dropped (a report must not abort a load).
using LoadProgress = std::function<void(float)>;

class Model {
public:
    // Throws ModelLoadError.
    explicit Model(const ModelLoad & load, const LoadProgress & on_progress = {});

    llama_model * get() const { return model_.get(); }
    const llama_vocab * vocab() const { return llama_model_get_vocab(model_.get()); }
    const ModelInfo & info() const { return info_; }

private:
    ModelPtr model_;
    ModelInfo info_;
};

// SHA-256 over the GGUF header + KV data + tensor table, the first MiB of tensor data and the file
// size. Two models with the same architecture and shapes but other weights differ in the sampled
// tensor bytes (and, for real models, in their metadata). Throws ModelLoadError.
std::string model_fingerprint(const std::string & path);

}  // namespace sk

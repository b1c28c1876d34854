#include "model.h"

#include "errors.h"
#include "hash.h"

#include <gguf.h>

#include <cstdio>
#include <vector>

namespace sk {

namespace {

std::string meta_str(const llama_model * m, const char * key) {
    char buf[256];
    const int n = llama_model_meta_val_str(m, key, buf, sizeof(buf));
    return n < 0 ? std::string() : std::string(buf, std::min<size_t>(size_t(n), sizeof(buf) - 1));
}

std::map<std::string, std::string> all_meta(const llama_model * m) {
    std::map<std::string, std::string> out;
    const int n = llama_model_meta_count(m);
    std::vector<char> key(512);
    std::vector<char> val(4096);
    for (int i = 0; i < n; i++) {
        if (llama_model_meta_key_by_index(m, i, key.data(), key.size()) < 0) continue;
        const int vn = llama_model_meta_val_str_by_index(m, i, val.data(), val.size());
        if (vn < 0) continue;
        out[key.data()] = std::string(val.data(), std::min<size_t>(size_t(vn), val.size() - 1));
    }
    return out;
}

struct FileCloser {
    void operator()(FILE * f) const { std::fclose(f); }
};

}  // namespace

std::string model_fingerprint(const std::string & path) {
    gguf_init_params params{};
    params.no_alloc = true;
    params.ctx = nullptr;
    gguf_context * g = gguf_init_from_file(path.c_str(), params);
    if (g == nullptr) throw ModelLoadError("not a readable GGUF file: " + path);
    const size_t data_offset = gguf_get_data_offset(g);
    gguf_free(g);

    std::unique_ptr<FILE, FileCloser> f(std::fopen(path.c_str(), "rb"));
    if (!f) throw ModelLoadError("cannot open model file: " + path);
    std::fseek(f.get(), 0, SEEK_END);
    const long size = std::ftell(f.get());
    std::fseek(f.get(), 0, SEEK_SET);
    if (size < 0 || size_t(size) < data_offset) throw ModelLoadError("GGUF file shorter than its header: " + path);

    Sha256 h;
    const size_t want = std::min(size_t(size), data_offset + (size_t(1) << 20));
    std::vector<uint8_t> buf(1 << 16);
    size_t done = 0;
    while (done < want) {
        const size_t n = std::fread(buf.data(), 1, std::min(buf.size(), want - done), f.get());
        if (n == 0) throw ModelLoadError("short read on model file: " + path);
        h.update(buf.data(), n);
        done += n;
    }
    const uint64_t size_le = uint64_t(size);
    h.update(&size_le, sizeof(size_le));
    return h.hexdigest();
}

namespace {

// llama.cpp calls its progress callback once per tensor; the listener hears each tenth once.
struct ProgressTenths {
    const LoadProgress & report;
    int last = -1;

    static bool call(float progress, void * self) {
        auto * p = static_cast<ProgressTenths *>(self);
        const int tenth = int(progress * 10.0f);
        if (tenth > p->last) {
            p->last = tenth;
            try {
                p->report(progress);
            } catch (...) {
            }
        }
        return true;  // never cancels the load
    }
};

}  // namespace

Model::Model(const ModelLoad & load, const LoadProgress & on_progress) {
    const std::string & path = load.path;
    // Read the fingerprint first: it also rejects non-GGUF files before llama.cpp sees them.
    std::string fp = model_fingerprint(path);

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = load.n_gpu_layers;
    mp.use_extra_bufts = load.repack;
    // This llama.cpp takes one load mode instead of use_mmap/use_mlock. Its default (AUTO) maps the
    // file where every device can; --no-mmap reads it instead, --mlock locks what was loaded.
    if (!load.use_mmap) mp.load_mode = load.use_mlock ? LLAMA_LOAD_MODE_MLOCK : LLAMA_LOAD_MODE_NONE;
    else if (load.use_mlock) mp.load_mode = LLAMA_LOAD_MODE_MMAP_MLOCK;
    ProgressTenths tenths{on_progress};
    if (on_progress) {
        mp.progress_callback = &ProgressTenths::call;
        mp.progress_callback_user_data = &tenths;
    }
    model_.reset(llama_model_load_from_file(path.c_str(), mp));
    if (!model_) throw ModelLoadError("llama.cpp could not load the model: " + path);

    llama_model * m = model_.get();
    const llama_vocab * v = llama_model_get_vocab(m);
    info_.path = path;
    info_.fingerprint = std::move(fp);
    info_.arch = meta_str(m, "general.architecture");
    char desc[256];
    llama_model_desc(m, desc, sizeof(desc));
    info_.description = desc;
    info_.n_vocab = llama_vocab_n_tokens(v);
    info_.n_ctx_train = llama_model_n_ctx_train(m);
    info_.n_embd = llama_model_n_embd(m);
    info_.n_layer = llama_model_n_layer(m);
    info_.n_params = llama_model_n_params(m);
    info_.size_bytes = llama_model_size(m);
    info_.recurrent = llama_model_is_recurrent(m);
    info_.hybrid = llama_model_is_hybrid(m);
    info_.n_swa = llama_model_n_swa(m);
    const char * tmpl = llama_model_chat_template(m, nullptr);
    info_.chat_template = tmpl ? tmpl : "";
    info_.bos = llama_vocab_bos(v);
    info_.eos = llama_vocab_eos(v);
    info_.eot = llama_vocab_eot(v);
    info_.add_bos = llama_vocab_get_add_bos(v);
    info_.meta = all_meta(m);
}

}  // namespace sk

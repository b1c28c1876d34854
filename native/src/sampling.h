// A request's sampler chain. Samples from any logits vector, so the stored logits of a checkpoint
// or of the slot's last position serve an identical prompt exactly like fresh ones would.
#pragma once

#include "request.h"

#include <llama.h>

#include <memory>
#include <vector>

namespace sk {

struct SamplerDeleter {
    void operator()(llama_sampler * s) const { llama_sampler_free(s); }
};
using SamplerPtr = std::unique_ptr<llama_sampler, SamplerDeleter>;

class Sampler {
public:
    // Throws InvalidRequestError (bad grammar, out-of-vocabulary bias or stop token).
    Sampler(const llama_vocab * vocab, const RequestParams & p, uint32_t fallback_seed);

    // Feed prompt tokens to the penalties sampler only (a grammar must not see the prompt).
    void prime(const std::vector<llama_token> & prompt);
    llama_token sample(const float * logits);

private:
    const llama_vocab * vocab_;
    int n_vocab_;
    SamplerPtr chain_;
    llama_sampler * penalties_ = nullptr;  // owned by chain_
    std::vector<llama_token_data> cur_;
    int repeat_last_n_ = 0;
};

}  // namespace sk

#include "sampling.h"

#include "errors.h"

#include <algorithm>
#include <cmath>

namespace sk {

Sampler::Sampler(const llama_vocab * vocab, const RequestParams & p, uint32_t fallback_seed)
    : vocab_(vocab), n_vocab_(llama_vocab_n_tokens(vocab)), repeat_last_n_(p.repeat_last_n) {
    for (const auto & [tok, bias] : p.logit_bias) {
        if (tok < 0 || tok >= n_vocab_) {
            throw InvalidRequestError("logit_bias token " + std::to_string(tok) + " is outside the vocabulary (0.." +
                                      std::to_string(n_vocab_ - 1) + ")");
        }
    }
    chain_.reset(llama_sampler_chain_init(llama_sampler_chain_default_params()));
    llama_sampler * c = chain_.get();

    if (!p.logit_bias.empty()) {
        std::vector<llama_logit_bias> bias;
        for (const auto & [tok, b] : p.logit_bias) bias.push_back({tok, b});
        llama_sampler_chain_add(c, llama_sampler_init_logit_bias(n_vocab_, int32_t(bias.size()), bias.data()));
    }
    const bool penalise = p.repeat_penalty != 1.0f || p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f;
    if (penalise && p.repeat_last_n != 0) {
        penalties_ = llama_sampler_init_penalties(n_vocab_, p.repeat_last_n, p.repeat_penalty, p.frequency_penalty,
                                                  p.presence_penalty);
        llama_sampler_chain_add(c, penalties_);
    }
    if (!p.grammar.empty()) {
        llama_sampler * g = nullptr;
        if (p.grammar_lazy) {
            if (p.grammar_trigger_patterns.empty() && p.grammar_trigger_tokens.empty()) {
                throw InvalidRequestError("a lazy grammar needs trigger patterns or tokens");
            }
            std::vector<const char *> patterns;
            for (const auto & s : p.grammar_trigger_patterns) patterns.push_back(s.c_str());
            g = llama_sampler_init_grammar_lazy_patterns(vocab, p.grammar.c_str(), "root", patterns.data(),
                                                         patterns.size(), p.grammar_trigger_tokens.data(),
                                                         p.grammar_trigger_tokens.size());
        } else {
            g = llama_sampler_init_grammar(vocab, p.grammar.c_str(), "root");
        }
        if (g == nullptr) throw InvalidRequestError("the grammar does not parse (GBNF with a 'root' rule expected)");
        llama_sampler_chain_add(c, g);
        // llama.cpp's grammar aborts on a token it cannot accept: a prefill the grammar refuses is
        // a grammar that does not fit the prompt, the request's fault.
        for (llama_token t : p.grammar_prefill) {
            if (t < 0 || t >= n_vocab_) throw InvalidRequestError("grammar prefill token outside the vocabulary");
            llama_token_data cand{t, 0.0f, 0.0f};
            llama_token_data_array one{&cand, 1, -1, false};
            llama_sampler_apply(g, &one);
            if (std::isinf(cand.logit)) throw InvalidRequestError("the grammar refuses the generation prompt");
            llama_sampler_accept(g, t);
        }
    }
    if (p.temperature <= 0.0f) {
        llama_sampler_chain_add(c, llama_sampler_init_greedy());
    } else {
        if (p.top_k > 0) llama_sampler_chain_add(c, llama_sampler_init_top_k(p.top_k));
        if (p.top_p < 1.0f) llama_sampler_chain_add(c, llama_sampler_init_top_p(p.top_p, 1));
        if (p.min_p > 0.0f) llama_sampler_chain_add(c, llama_sampler_init_min_p(p.min_p, 1));
        llama_sampler_chain_add(c, llama_sampler_init_temp(p.temperature));
        const uint32_t seed = p.seed < 0 ? fallback_seed : uint32_t(p.seed);
        llama_sampler_chain_add(c, llama_sampler_init_dist(seed));
    }
    cur_.resize(size_t(n_vocab_));
}

void Sampler::prime(const std::vector<llama_token> & prompt) {
    if (penalties_ == nullptr) return;
    const size_t n = repeat_last_n_ < 0 ? prompt.size() : std::min(prompt.size(), size_t(repeat_last_n_));
    for (size_t i = prompt.size() - n; i < prompt.size(); i++) llama_sampler_accept(penalties_, prompt[i]);
}

llama_token Sampler::sample(const float * logits) {
    for (int i = 0; i < n_vocab_; i++) cur_[size_t(i)] = llama_token_data{i, logits[i], 0.0f};
    llama_token_data_array arr{cur_.data(), cur_.size(), -1, false};
    llama_sampler_apply(chain_.get(), &arr);
    if (arr.selected < 0 || size_t(arr.selected) >= arr.size) {
        throw NativeError("sampler selected no token (grammar exhausted?)");
    }
    const llama_token tok = arr.data[arr.selected].id;
    llama_sampler_accept(chain_.get(), tok);
    return tok;
}

}  // namespace sk

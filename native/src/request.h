// What a caller asks of a slot, and what the engine reports back.
#pragma once

#include <llama.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace sk {

struct RequestParams {
    std::vector<llama_token> prompt;
    int n_predict = -1;
    float temperature = 0.8f;
    int top_k = 40;
    float top_p = 0.95f;
    float min_p = 0.05f;
    int64_t seed = -1;
    float repeat_penalty = 1.0f;
    int repeat_last_n = 64;
    float presence_penalty = 0.0f;
    float frequency_penalty = 0.0f;
    std::map<llama_token, float> logit_bias;
    std::vector<llama_token> stop_tokens;
    // Generation ends on the token that completes one of these in the generated text (token pieces
    // without special tokens' text, but `preserved_tokens` with theirs), in the same step: the slot
    // then holds exactly the tokens up to it, whenever the caller reads the event stream.
    std::vector<std::string> stop_strings;
    std::vector<llama_token> preserved_tokens;
    bool ignore_eos = false;
    std::string grammar;
    // A lazy grammar (llama.cpp's tool calls under tool_choice auto) applies only from the first
    // match of a trigger pattern (regex over the generated text) or trigger token on; before that
    // the model writes freely. `grammar_prefill`: tokens the prompt already holds that the grammar
    // must accept before generation starts (the generation prompt a tool-call grammar begins with).
    bool grammar_lazy = false;
    std::vector<std::string> grammar_trigger_patterns;
    std::vector<llama_token> grammar_trigger_tokens;
    std::vector<llama_token> grammar_prefill;
    std::vector<int> checkpoint_hints;
    bool cache_prompt = true;
    // Other slots whose state this request may start from when it reuses more of the prompt than
    // the request's own slot holds (a prefix several sessions share: a system prompt, tools). The
    // caller decides who may share with whom (the gateway lists one tenant's slots only), and
    // `owner` makes it hold whatever happened to those slots since: a slot takes the owner of the
    // request that last ran on it (restores and erases clear it), and a request starts only from
    // slots of its own owner.
    std::vector<int> prefix_sources;
    std::string owner;
    // Log probabilities: 0 = off; n > 0 makes every token event carry the sampled token's logprob
    // and the n most probable tokens, from the raw logits (softmax over the vocabulary).
    int n_probs = 0;
    // Context shift (EngineConfig::context_shift): prompt tokens always kept (-1 = the whole
    // prompt; the BOS is kept on top of n_keep when the model adds one), and how many to drop per
    // shift (0 = half of what follows the kept ones).
    int n_keep = 0;
    int n_discard = 0;
    // llama-server's `return_progress`: a `progress` event when the prompt's evaluation starts
    // (what was reused) and after every prompt chunk evaluated, before the first token.
    bool report_progress = false;
    // llama-server's `timings_per_token`: every token event carries the timings so far.
    bool timings_per_token = false;
};

constexpr int kMaxProbs = 100;  // bound on RequestParams::n_probs

struct Timings {
    int prompt_n = 0;
    int cache_n = 0;
    int predicted_n = 0;
    double prompt_ms = 0.0;
    double predicted_ms = 0.0;
    std::string reuse = "none";  // none | live | checkpoint | logits
    bool restored = false;
    int source_slot = -1;  // the slot whose state the request started from (-1: its own)
    // The state the prompt was compared with: the request's own slot, the slot it started from,
    // or the source sharing the longest common prefix with it. Its tokens, how many of them the
    // last prompt it served had (0: unknown, a restored state), and the common prefix.
    int candidate_slot = -1;
    int candidate_n = 0;
    int candidate_prompt_n = 0;
    int common_n = 0;
    int checkpoints_created = 0;
    int context_shifts = 0;  // times the context was shifted during generation (llama-server's "truncated")
};

struct Event {
    int64_t request_id = -1;
    std::string kind;  // token | progress | done | error
    llama_token token = -1;
    std::string piece;
    std::string stop_reason;  // eos | stop_token | stop_word | length | context | cancelled
    Timings timings;
    std::string message;
    int slot = -1;
    // Token events of a request with n_probs > 0 (else 0 and empty): the sampled token's natural-log
    // probability and the n_probs most probable tokens, most probable first.
    float logprob = 0.0f;
    std::vector<std::pair<llama_token, float>> top_logprobs;
    // Progress events: the prompt's length and the time since the request started; `timings` then
    // holds what was reused (cache_n), what was evaluated so far (prompt_n) and the time that took
    // (prompt_ms: 0 before the first chunk, as llama-server counts it).
    int prompt_total = 0;
    double elapsed_ms = 0.0;
};

}  // namespace sk

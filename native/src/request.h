// What a caller asks of a slot, and what the engine reports back.
#pragma once

#include <llama.h>

#include <cstdint>
#include <map>
#include <string>
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
    bool ignore_eos = false;
    std::string grammar;
    std::vector<int> checkpoint_hints;
    bool cache_prompt = true;
};

struct Timings {
    int prompt_n = 0;
    int cache_n = 0;
    int predicted_n = 0;
    double prompt_ms = 0.0;
    double predicted_ms = 0.0;
    std::string reuse = "none";  // none | live | checkpoint | logits
    bool restored = false;
    int checkpoints_created = 0;
};

struct Event {
    int64_t request_id = -1;
    std::string kind;  // token | done | error
    llama_token token = -1;
    std::string piece;
    std::string stop_reason;  // eos | stop_token | length | context | cancelled
    Timings timings;
    std::string message;
    int slot = -1;
};

}  // namespace sk

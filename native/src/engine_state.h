// Private to the engine's translation units (engine.cpp, engine_slots.cpp): the per-slot and
// per-request state the loop thread owns, and the helpers both files use. Not part of the API.
#pragma once

#include "engine.h"

#include "errors.h"

#include <chrono>
#include <future>
#include <memory>

namespace sk {

inline double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline double ms_since(double t0) { return (now_s() - t0) * 1000.0; }

inline Event error_event(int64_t request_id, int slot, const std::string & message) {
    Event e;
    e.request_id = request_id;
    e.kind = "error";
    e.message = message;
    e.slot = slot;
    return e;
}

struct Engine::Active {
    int64_t id = 0;
    RequestParams params;
    std::unique_ptr<Sampler> sampler;
    bool generating = false;
    size_t cursor = 0;                      // next prompt index to evaluate
    std::vector<PlannedCheckpoint> plan;    // checkpoints still to capture, ascending
    size_t chunk_end = 0;                   // prompt index the chunk in flight ends at
    llama_token pending = -1;               // sampled, not yet evaluated
    int batch_index = -1;                   // batch row whose logits are ours
    int n_sampled = 0;
    std::string stop_tail;                  // the end of the generated text, for stop strings
    Timings timings;
    double t_start = 0.0;
    double t_prompt_done = 0.0;
};

struct Engine::Slot {
    int id = 0;
    std::vector<llama_token> tokens;        // evaluated tokens (positions 0..n-1)
    std::vector<float> last_logits;         // logits after tokens.back(); empty = unknown
    std::vector<Checkpoint> checkpoints;    // ascending n_tokens
    bool restored = false;                  // state came from a file and has not served yet
    int prompt_n = 0;                       // the last prompt it served (0: unknown, e.g. restored)
    std::string owner;                      // RequestParams::owner of the last request it served
    double last_used = 0.0;
    std::unique_ptr<Active> active;
};

struct Engine::Queued {
    int64_t id = 0;
    int slot = -1;
    RequestParams params;
    std::unique_ptr<Sampler> sampler;
};

template <typename R> R Engine::call(std::function<R()> fn) {
    auto done = std::make_shared<std::promise<R>>();
    std::future<R> fut = done->get_future();
    // The command holds the only reference to the promise, so dropping it unrun breaks the promise.
    post({[fn = std::move(fn), done = std::move(done)] {
              // A typed error is an answer: the command checked before it changed anything (or put
              // the slot back in order, like restore). Anything else escapes to the loop, which
              // cannot vouch for its state any more and faults.
              try {
                  done->set_value(fn());
              } catch (const NativeError &) {
                  done->set_exception(std::current_exception());
              }
          },
          nullptr});
    try {
        return fut.get();  // rethrows the typed error fn threw
    } catch (const std::future_error &) {
        // The loop stopped without running (or finishing) the command and dropped it, which broke
        // the promise: the engine faulted.
        std::lock_guard<std::mutex> lk(cmd_mu_);
        throw EngineClosedError(closed_message_locked());
    }
}

}  // namespace sk

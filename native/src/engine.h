// The engine: one model, N slots (one llama.cpp sequence each) on one llama_context created with a
// single unified KV stream, so a slot file loads into any engine of the same model. The context and
// every slot belong to the loop thread (see native/DESIGN.md); other threads talk to it through the
// command queue and read results from the event queue. Whatever the loop throws ends the engine
// (a "fault"): every request gets an error event, every waiting caller an EngineClosedError.
#pragma once

#include "engine_config.h"
#include "model.h"
#include "request.h"
#include "reuse.h"
#include "sampling.h"
#include "slotfile.h"

#include <llama.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace sk {

struct SlotFileInfo {
    std::string path;
    int n_tokens = 0;
    uint64_t n_bytes = 0;
    int n_checkpoints = 0;
    double ms = 0.0;
};

// A slot's state copied on the loop thread (memory speed), to be written to a slot file on any
// other thread while the slot goes on serving.
struct SlotSnapshot {
    int slot = 0;
    std::vector<llama_token> tokens;
    std::vector<uint8_t> state;
    std::vector<float> logits;
    std::vector<Checkpoint> checkpoints;
    StreamLayout layout;  // of `state`, which is as llama.cpp wrote it
    double t0 = 0.0;  // when the save began
};

struct SlotInfo {
    int id = 0;
    bool busy = false;
    int64_t request_id = -1;
    int queued = 0;
    int n_tokens = 0;
    int n_checkpoints = 0;
    uint64_t checkpoint_bytes = 0;
    bool restored = false;
    double last_used = 0.0;
};

struct ContextDeleter {
    void operator()(llama_context * c) const { llama_free(c); }
};
using ContextPtr = std::unique_ptr<llama_context, ContextDeleter>;

class Engine {
public:
    // Throws ModelLoadError, InvalidRequestError. `on_load_progress` hears the weights load (model.h).
    explicit Engine(const EngineConfig & cfg, const LoadProgress & on_load_progress = {});
    ~Engine();
    Engine(const Engine &) = delete;
    Engine & operator=(const Engine &) = delete;

    const ModelInfo & model() const { return model_.info(); }
    const EngineConfig & config() const { return cfg_; }  // fixed at construction
    int n_ctx_slot() const { return n_ctx_slot_; }
    // Whether each slot has a KV stream of its own (see Engine::Engine).
    bool kv_streams() const { return kv_streams_; }

    std::vector<llama_token> tokenize(const std::string & text, bool add_special, bool parse_special) const;
    std::string detokenize(const std::vector<llama_token> & tokens, bool remove_special, bool unparse_special) const;
    std::string token_piece(llama_token t, bool special) const;

    int64_t submit(int slot, RequestParams params);
    bool cancel(int64_t request_id);
    void cancel_nowait(int64_t request_id);  // queued for the loop; the done event still follows
    std::vector<Event> poll();
    std::vector<Event> wait(double timeout_s);
    int event_fd() const { return event_fd_; }

    SlotFileInfo save_slot(int slot, const std::string & path);  // snapshot_slot + write_snapshot
    // The slot's state now (SlotBusyError while it processes a request); its file is written by
    // write_snapshot, which touches nothing of the engine's but its metrics.
    std::shared_ptr<SlotSnapshot> snapshot_slot(int slot);
    // `durable`: synced to its disk before the rename (a handoff's file, read once on this node
    // and deleted, needs no sync: its loss is a crash's, which ends the handoff anyway).
    SlotFileInfo write_snapshot(const SlotSnapshot & snap, const std::string & path, bool durable = true);
    SlotFileInfo restore_slot(int slot, const std::string & path);
    int erase_slot(int slot);
    std::vector<SlotInfo> slots();
    std::vector<llama_token> slot_tokens(int slot);
    std::map<std::string, int64_t> metrics();
    // Stop the loop and wait for it; idempotent and safe from any thread (every caller returns once
    // the loop thread is gone), also after a fault.
    void close();
    bool closed() const;
    std::string fault() const;  // why the loop died; "" while healthy or after a plain close()

    // Test hook: make the loop throw std::bad_alloc, at the top of its next iteration ("command")
    // or in the next checkpoint capture ("checkpoint"), to exercise the fault path for real.
    void inject_fault_for_tests(const std::string & where);

private:
    struct Active;
    struct Slot;
    struct Queued;

    // A closure for the loop. `refuse` (optional) tells its requester when the loop stops before
    // running it; a call()'s caller needs none: dropping the command breaks its promise.
    struct Command {
        std::function<void()> run;
        std::function<void(const std::string & why)> refuse;
    };

    // --- loop thread only ---
    void loop();
    void run_loop(std::deque<Command> & cmds);
    void shut_down(std::deque<Command> & unrun, const std::string & fault);
    void start_queued();
    void start_request(Slot & s, Queued && q);
    bool step();  // one batch; false when there was nothing to do
    // Whether the token completes a stop string of the request (RequestParams::stop_strings).
    bool completes_stop_string(Active & a, llama_token t, const std::string & piece) const;
    void after_token(Slot & s, const float * logits);
    void finish(Slot & s, const std::string & reason);
    void report_progress(Slot & s);
    Timings timings_so_far(const Slot & s) const;
    bool cancel_on_loop(int64_t request_id);
    void fail_slot(Slot & s, const std::string & message);
    bool shift_context(Slot & s);
    void token_probs(const float * logits, llama_token sampled, int n_probs, Event & e);
    void make_room_in_pool();
    bool evict_idle_slot(int except_slot);
    size_t cells_held(const Slot & s) const;
    void warm_up();
    void capture_checkpoint(Slot & s, CheckpointKind kind, const float * logits);
    std::vector<Checkpoint> stored_ladder(const std::vector<Checkpoint> & ladder);
    void enforce_checkpoint_budget(Slot & s);
    void clear_slot_memory(Slot & s);
    // The slot among the request's prefix_sources worth starting from instead of `s` (which would
    // serve `own_keep` prompt tokens), or -1; `report` then names the candidate the prompt is
    // compared with (engine_prefix.cpp).
    int prefix_source(const Slot & s, const RequestParams & p, int own_keep, Timings & report) const;
    void describe_candidate(const Slot & o, int common, Timings & report) const;
    // `to` becomes a copy of `from` (memory, tokens, checkpoints, logits); false (and `to` empty)
    // when llama.cpp refuses it.
    bool copy_slot(const Slot & from, Slot & to);
    // A sliding-window copy's own window, apart from its source's (engine_prefix.cpp says why).
    bool own_window(const Slot & s);
    MemoryView memory_view(const Slot & s) const;
    bool slot_busy(const Slot & s) const;

    // --- any thread ---
    void check_slot_id(int slot) const;
    void push_event(Event && e);
    void bump(const std::string & name, int64_t by = 1);
    // Run fn on the loop thread and wait for it (the caller's GIL is released by the bindings).
    template <typename R> R call(std::function<R()> fn);
    void post(Command cmd);
    std::string closed_message_locked() const;  // cmd_mu_ held

    const EngineConfig cfg_;  // read by every thread without a lock, so never written after construction
    Model model_;
    ContextPtr ctx_;
    int n_ctx_slot_ = 0;
    bool kv_streams_ = false;
    int n_ctx_ = 0;        // KV cells in the context (the pool every slot draws from)
    int n_vocab_ = 0;
    std::vector<int> prob_order_;  // loop thread: scratch for the top-n_probs selection

    std::vector<Slot> slots_;          // loop thread
    std::deque<Queued> queued_;        // loop thread
    llama_batch batch_{};

    mutable std::mutex cmd_mu_;
    std::condition_variable cmd_cv_;
    std::deque<Command> commands_;
    bool closing_ = false;  // no more commands: close() was called or the loop stopped
    std::string fault_;     // set once, by the loop, when it dies of an exception
    std::atomic<bool> fault_at_checkpoint_{false};  // inject_fault_for_tests("checkpoint")

    std::mutex join_mu_;  // one close() joins; a concurrent one waits for it

    std::mutex ev_mu_;
    std::condition_variable ev_cv_;
    std::vector<Event> events_;
    int event_fd_ = -1;

    std::mutex metrics_mu_;
    std::map<std::string, int64_t> metrics_;

    std::atomic<int64_t> next_request_id_{1};
    std::thread thread_;
};

}  // namespace sk

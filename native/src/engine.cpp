#include "engine_state.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <new>
#include <random>

#include <sys/eventfd.h>
#include <unistd.h>

namespace sk {

Engine::Engine(const EngineConfig & cfg, const LoadProgress & on_load_progress)
    : cfg_(checked_config(cfg)), model_(cfg.model, on_load_progress) {
    if (cfg_.context_shift && model().needs_checkpoints_to_trim()) {
        // A recurrent state summarises every token it has seen: nothing can be dropped from the
        // middle (seq_rm refuses), so a shift would corrupt the sequence. llama-server turns the
        // option off with a warning; an explicit flag the engine cannot honour is refused instead.
        throw InvalidRequestError(std::string("--context-shift cannot be used with this model (") + model().arch +
                                  ", " + (model().hybrid ? "hybrid" : "recurrent") +
                                  "): its recurrent state cannot drop tokens; start without --context-shift");
    }

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = uint32_t(cfg_.n_ctx);
    cp.n_batch = uint32_t(cfg_.n_batch);
    cp.n_ubatch = uint32_t(std::min(cfg_.n_ubatch, cfg_.n_batch));
    cp.n_seq_max = uint32_t(cfg_.n_slots);
    const int hw = int(std::max(1u, std::thread::hardware_concurrency()));
    cp.n_threads = cfg_.n_threads > 0 ? cfg_.n_threads : hw;
    cp.n_threads_batch = cp.n_threads;
    // A KV stream per slot where the saved state can be brought to the one-stream form slot files
    // hold (seqstate.h): a plain hybrid memory (attention cache, then recurrent state; no sliding
    // window; not qwen4exp's indexed attention) and more than one slot. A slot's attention then
    // spans its own cells only, not every slot's, masked, which spares multi-slot prefill some work
    // (figures: docs/benchmarks.md; llama-server with and without -kvu). llama.cpp rounds each stream
    // up to a multiple of 256 cells (up to 255 more per slot than one stream would hold); a slot
    // still gets n_ctx / n_slots of them, as with one stream. Otherwise one stream, whatever
    // cfg_.kv_unified says, which then only decides how much of it one slot may use. Either way a
    // slot file restores into any engine of this model and context shape, whatever its slot count.
    const ModelInfo & mi = model();
    kv_streams_ = !cfg_.kv_unified && cfg_.n_slots > 1 && mi.hybrid && !mi.recurrent && mi.n_swa == 0 &&
                  mi.arch != "qwen4exp";
    cp.kv_unified = !kv_streams_;
    cp.swa_full = cfg_.swa_full;
    cp.flash_attn_type = cfg_.flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k = kv_cache_type(cfg_.cache_type_k, "--cache-type-k");
    cp.type_v = kv_cache_type(cfg_.cache_type_v, "--cache-type-v");
    cp.no_perf = true;
    ctx_.reset(llama_init_from_model(model_.get(), cp));
    if (!ctx_) {
        throw ModelLoadError("llama.cpp could not create a context (n_ctx=" + std::to_string(cfg_.n_ctx) +
                             ", KV types k=" + cfg_.cache_type_k + " v=" + cfg_.cache_type_v + ", flash attention " +
                             (cfg_.flash_attn ? "on" : "off") + "; a quantized type needs a head size that is a "
                             "multiple of its block)");
    }
    if (cfg_.context_shift && !llama_memory_can_shift(llama_get_memory(ctx_.get()))) {
        throw InvalidRequestError(std::string("--context-shift: llama.cpp cannot shift the KV cache of this model (") +
                                  model().arch + (model().n_swa > 0 && !cfg_.swa_full ? "; a sliding-window cache "
                                  "shifts only with --swa-full" : "") + "); start without --context-shift");
    }

    // With streams llama_n_ctx counts every stream's rounded-up cells; the slots are sized as one
    // stream of n_ctx (rounded up to 256, as llama.cpp does) would size them.
    n_ctx_ = kv_streams_ ? (cfg_.n_ctx + 255) / 256 * 256 : int(llama_n_ctx(ctx_.get()));
    n_ctx_slot_ = cfg_.kv_unified ? n_ctx_ : n_ctx_ / cfg_.n_slots;
    n_vocab_ = model().n_vocab;
    slots_.resize(size_t(cfg_.n_slots));
    for (int i = 0; i < cfg_.n_slots; i++) slots_[size_t(i)].id = i;
    event_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (event_fd_ < 0) throw NativeError("eventfd failed");
    batch_ = llama_batch_init(std::max(cfg_.n_batch, cfg_.n_slots), 0, 1);

    // Every llama_decode runs on the loop thread, the warmup too. ggml's CPU backend parallelises
    // with OpenMP, and libgomp keeps a team of workers per thread that ever ran a parallel region:
    // a warmup on the caller's thread left a second idle team behind, so with more OpenMP threads
    // than cores libgomp stopped spinning at its barriers and slept on futexes instead — every
    // single-token decode then ran far slower than the same libllama called from one thread
    // (figures: docs/benchmarks.md).
    std::promise<void> warmed;
    std::future<void> ready = warmed.get_future();
    thread_ = std::thread([this, warmup = cfg_.warmup, warmed = std::move(warmed)]() mutable {
        try {
            if (warmup) warm_up();
            warmed.set_value();
        } catch (...) {
            warmed.set_exception(std::current_exception());
            return;
        }
        loop();
    });
    try {
        ready.get();
    } catch (...) {
        thread_.join();
        llama_batch_free(batch_);
        ::close(event_fd_);
        throw;
    }
}

// llama-server's warmup (common_init_from_params): decode BOS+EOS once, then forget it, so that the
// first request does not pay for first-touch weight pages, backend buffers and graph allocation.
void Engine::warm_up() {
    std::vector<llama_token> tmp;
    if (model().bos >= 0) tmp.push_back(model().bos);
    if (model().eos >= 0) tmp.push_back(model().eos);
    if (tmp.empty()) tmp.push_back(0);
    if (int(tmp.size()) > cfg_.n_batch) tmp.resize(size_t(cfg_.n_batch));
    const int rc = llama_decode(ctx_.get(), llama_batch_get_one(tmp.data(), int32_t(tmp.size())));
    llama_memory_clear(llama_get_memory(ctx_.get()), true);
    llama_synchronize(ctx_.get());
    if (rc != 0) throw ModelLoadError("the warmup decode failed with code " + std::to_string(rc) + " (--no-warmup skips it)");
    bump("warmups");
}

Engine::~Engine() {
    close();
    llama_batch_free(batch_);
    if (event_fd_ >= 0) ::close(event_fd_);
}

void Engine::close() {
    {
        std::lock_guard<std::mutex> lk(cmd_mu_);
        closing_ = true;
    }
    cmd_cv_.notify_all();
    // std::thread::join from two threads at once is undefined: one close() joins, a concurrent one
    // waits here until the loop is gone and then finds nothing to join. After a fault the loop has
    // ended on its own and the join returns at once.
    std::lock_guard<std::mutex> lk(join_mu_);
    if (thread_.joinable()) thread_.join();
}

bool Engine::closed() const {
    std::lock_guard<std::mutex> lk(cmd_mu_);
    return closing_;
}

std::string Engine::fault() const {
    std::lock_guard<std::mutex> lk(cmd_mu_);
    return fault_;
}

std::string Engine::closed_message_locked() const {
    if (fault_.empty()) return "the engine is closed";
    return "the engine is closed: its loop failed (" + fault_ + ")";
}

void Engine::inject_fault_for_tests(const std::string & where) {
    if (where == "command") {
        post({[] { throw std::bad_alloc(); }, nullptr});
    } else if (where == "checkpoint") {
        {
            std::lock_guard<std::mutex> lk(cmd_mu_);
            if (closing_) throw EngineClosedError(closed_message_locked());
        }
        fault_at_checkpoint_ = true;
    } else {
        throw InvalidRequestError("unknown fault site '" + where + "' (command | checkpoint)");
    }
}

// ---------------------------------------------------------------------------------------------
// Any thread

void Engine::check_slot_id(int slot) const {
    if (slot < 0 || slot >= cfg_.n_slots) {
        throw InvalidRequestError("slot " + std::to_string(slot) + " does not exist (this engine has slots 0.." +
                                  std::to_string(cfg_.n_slots - 1) + ")");
    }
}

std::vector<llama_token> Engine::tokenize(const std::string & text, bool add_special, bool parse_special) const {
    const llama_vocab * v = model_.vocab();
    int n = -llama_tokenize(v, text.data(), int32_t(text.size()), nullptr, 0, add_special, parse_special);
    if (n < 0) n = -n;  // an empty text returns 0
    std::vector<llama_token> out(size_t(n) + 1);
    const int got = llama_tokenize(v, text.data(), int32_t(text.size()), out.data(), int32_t(out.size()), add_special,
                                   parse_special);
    if (got < 0) throw NativeError("tokenization failed");
    out.resize(size_t(got));
    return out;
}

std::string Engine::token_piece(llama_token t, bool special) const {
    if (t < 0 || t >= n_vocab_) throw InvalidRequestError("token " + std::to_string(t) + " is outside the vocabulary");
    char buf[256];
    const int n = llama_token_to_piece(model_.vocab(), t, buf, sizeof(buf), 0, special);
    if (n >= 0) return std::string(buf, size_t(n));
    std::string big(size_t(-n), '\0');
    llama_token_to_piece(model_.vocab(), t, big.data(), int32_t(big.size()), 0, special);
    return big;
}

std::string Engine::detokenize(const std::vector<llama_token> & tokens, bool remove_special, bool unparse_special) const {
    for (llama_token t : tokens) {
        if (t < 0 || t >= n_vocab_) throw InvalidRequestError("token " + std::to_string(t) + " is outside the vocabulary");
    }
    std::string out(tokens.size() * 8 + 16, '\0');
    int n = llama_detokenize(model_.vocab(), tokens.data(), int32_t(tokens.size()), out.data(), int32_t(out.size()),
                             remove_special, unparse_special);
    if (n < 0) {
        out.resize(size_t(-n));
        n = llama_detokenize(model_.vocab(), tokens.data(), int32_t(tokens.size()), out.data(), int32_t(out.size()),
                             remove_special, unparse_special);
    }
    out.resize(size_t(std::max(n, 0)));
    return out;
}

void Engine::push_event(Event && e) {
    {
        std::lock_guard<std::mutex> lk(ev_mu_);
        events_.push_back(std::move(e));
    }
    ev_cv_.notify_all();
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t w = ::write(event_fd_, &one, sizeof(one));
}

std::vector<Event> Engine::poll() {
    uint64_t drained;
    [[maybe_unused]] ssize_t r = ::read(event_fd_, &drained, sizeof(drained));
    std::lock_guard<std::mutex> lk(ev_mu_);
    std::vector<Event> out;
    out.swap(events_);
    return out;
}

std::vector<Event> Engine::wait(double timeout_s) {
    {
        std::unique_lock<std::mutex> lk(ev_mu_);
        ev_cv_.wait_for(lk, std::chrono::duration<double>(std::max(0.0, timeout_s)), [this] { return !events_.empty(); });
    }
    return poll();
}

void Engine::bump(const std::string & name, int64_t by) {
    std::lock_guard<std::mutex> lk(metrics_mu_);
    metrics_[name] += by;
}

std::map<std::string, int64_t> Engine::metrics() {
    std::lock_guard<std::mutex> lk(metrics_mu_);
    return metrics_;
}

void Engine::post(Command cmd) {
    {
        std::lock_guard<std::mutex> lk(cmd_mu_);
        if (closing_) throw EngineClosedError(closed_message_locked());
        commands_.push_back(std::move(cmd));
    }
    cmd_cv_.notify_all();
}

int64_t Engine::submit(int slot, RequestParams params) {
    if (slot != -1) check_slot_id(slot);
    const int L = int(params.prompt.size());
    if (L == 0) throw InvalidRequestError("the prompt is empty");
    if (L >= n_ctx_slot_) {
        throw InvalidRequestError("the prompt has " + std::to_string(L) + " tokens, the slot's context holds " +
                                  std::to_string(n_ctx_slot_) + " (prompt must be shorter than the context)");
    }
    for (llama_token t : params.prompt) {
        if (t < 0 || t >= n_vocab_) throw InvalidRequestError("prompt token " + std::to_string(t) + " is outside the vocabulary");
    }
    for (llama_token t : params.stop_tokens) {
        if (t < 0 || t >= n_vocab_) throw InvalidRequestError("stop token " + std::to_string(t) + " is outside the vocabulary");
    }
    if (params.n_probs < 0 || params.n_probs > kMaxProbs) {
        throw InvalidRequestError("n_probs must be within 0.." + std::to_string(kMaxProbs));
    }
    if (params.n_keep < -1) throw InvalidRequestError("n_keep must be >= -1 (-1 = the whole prompt)");
    if (params.n_discard < 0) throw InvalidRequestError("n_discard must be >= 0 (0 = half)");
    static std::atomic<uint32_t> seed_counter{uint32_t(std::random_device{}())};
    Queued q;
    q.sampler = std::make_unique<Sampler>(model_.vocab(), params, seed_counter.fetch_add(0x9E3779B9u));
    q.id = next_request_id_++;
    q.slot = slot;
    q.params = std::move(params);
    const int64_t id = q.id;
    auto holder = std::make_shared<Queued>(std::move(q));
    post({[this, holder] { queued_.push_back(std::move(*holder)); },
          [this, id, slot](const std::string & why) { push_event(error_event(id, slot, why)); }});
    return id;
}

void Engine::cancel_nowait(int64_t request_id) {
    try {
        post({[this, request_id] { cancel_on_loop(request_id); }, nullptr});
    } catch (const EngineClosedError &) {
        // closing: every request ends with an error event anyway
    }
}

bool Engine::cancel(int64_t request_id) {
    return call<bool>([this, request_id] { return cancel_on_loop(request_id); });
}

bool Engine::cancel_on_loop(int64_t request_id) {
    {
        for (auto it = queued_.begin(); it != queued_.end(); ++it) {
            if (it->id == request_id) {
                Event e;
                e.request_id = request_id;
                e.kind = "done";
                e.stop_reason = "cancelled";
                e.slot = it->slot;
                queued_.erase(it);
                push_event(std::move(e));
                return true;
            }
        }
        for (auto & s : slots_) {
            if (s.active && s.active->id == request_id) {
                finish(s, "cancelled");
                return true;
            }
        }
        return false;
    }
}

// ---------------------------------------------------------------------------------------------
// Loop thread

void Engine::loop() {
    std::deque<Command> cmds;  // taken from commands_, not yet run
    try {
        std::string fault;
        try {
            run_loop(cmds);
        } catch (const std::exception & e) {
            fault = e.what();
            if (fault.empty()) fault = "an exception with no message";
        } catch (...) {
            fault = "an exception of unknown type";
        }
        shut_down(cmds, fault);
    } catch (...) {
        // Out of memory even for the error events. Refuse everything from now on; dropping the
        // commands still breaks the promises their callers wait on. (13 characters fit the
        // string's inline buffer: this assignment does not allocate.)
        std::lock_guard<std::mutex> lk(cmd_mu_);
        closing_ = true;
        if (fault_.empty()) fault_ = "out of memory";
        std::deque<Command> late;
        late.swap(commands_);
        cmds.clear();
    }
}

void Engine::run_loop(std::deque<Command> & cmds) {
    for (;;) {
        {
            std::unique_lock<std::mutex> lk(cmd_mu_);
            const bool idle = queued_.empty() &&
                              std::none_of(slots_.begin(), slots_.end(), [](const Slot & s) { return bool(s.active); });
            if (idle) cmd_cv_.wait(lk, [this] { return closing_ || !commands_.empty(); });
            cmds.swap(commands_);  // cmds is empty here
            if (closing_ && cmds.empty()) return;
        }
        // A command leaves the queue only once it has run: one that throws stays for shut_down.
        while (!cmds.empty()) {
            cmds.front().run();
            cmds.pop_front();
        }
        start_queued();
        step();
    }
}

void Engine::shut_down(std::deque<Command> & unrun, const std::string & fault) {
    std::deque<Command> late;
    {
        std::lock_guard<std::mutex> lk(cmd_mu_);
        closing_ = true;  // after a fault nobody called close(): refuse new work from here on
        fault_ = fault;
        late.swap(commands_);  // posted after the loop took its last batch
    }
    const std::string why = fault.empty() ? "the engine is shutting down" : "the engine failed: " + fault;
    // Every request ends with an error event and every waiting caller is answered, so nothing
    // hangs. The llama_context is not touched again: after a fault it may be mid-update.
    for (auto * q : {&unrun, &late}) {
        for (auto & c : *q) {
            if (c.refuse) c.refuse(why);
        }
        q->clear();  // a call()'s dropped promise raises EngineClosedError in its caller
    }
    for (auto & q : queued_) {
        // A request whose start threw may already be a slot's active one: one error event each.
        const bool active = std::any_of(slots_.begin(), slots_.end(),
                                        [&](const Slot & s) { return s.active && s.active->id == q.id; });
        if (!active) push_event(error_event(q.id, q.slot, why));
    }
    queued_.clear();
    for (auto & s : slots_) {
        if (!s.active) continue;
        Event e = error_event(s.active->id, s.id, why);
        e.timings = s.active->timings;
        s.active.reset();
        push_event(std::move(e));
    }
    if (!fault.empty()) {
        // Last, after every request's error: the engine-level event (request_id -1) that tells the
        // process its engine is gone.
        Event e;
        e.kind = "fault";
        e.message = fault;
        push_event(std::move(e));
    }
}

void Engine::start_queued() {
    for (auto it = queued_.begin(); it != queued_.end();) {
        int target = it->slot;
        if (target < 0) {
            std::vector<SlotCandidate> cands;
            for (const auto & s : slots_) {
                cands.push_back({s.id, !s.active, common_prefix(s.tokens, it->params.prompt), s.last_used});
            }
            // Like llama-server's --slot-prompt-similarity 0.1: a prefix shorter than a tenth of
            // the prompt does not count.
            target = choose_slot(cands, std::max<size_t>(2, it->params.prompt.size() / 10));
        } else if (slots_[size_t(target)].active) {
            target = -1;
        }
        if (target < 0) {
            ++it;
            continue;
        }
        // Erased only once started: if starting throws, the entry (its id and slot survive the move)
        // is still queued, so shut_down gives the request its error event.
        start_request(slots_[size_t(target)], std::move(*it));
        it = queued_.erase(it);
    }
}

void Engine::start_request(Slot & s, Queued && q) {
    auto a = std::make_unique<Active>();
    a->id = q.id;
    a->params = std::move(q.params);
    a->sampler = std::move(q.sampler);
    a->t_start = now_s();
    const auto & prompt = a->params.prompt;
    const int L = int(prompt.size());
    llama_memory_t mem = llama_get_memory(ctx_.get());

    // A slot another owner's request ran on last is never reused by this one (the caller clears
    // such a slot before it hands it over; this holds if it did not). A restore clears the owner.
    if (!s.owner.empty() && s.owner != a->params.owner) clear_slot_memory(s);
    const bool was_restored = s.restored;
    const int restored_tokens = was_restored ? int(s.tokens.size()) : 0;
    ReusePlan plan = plan_reuse(memory_view(s), prompt, a->params.cache_prompt);
    describe_candidate(s, int(common_prefix(s.tokens, prompt)), a->timings);
    int source = -1;
    if (a->params.cache_prompt && !a->params.prefix_sources.empty() && plan.kind != ReuseKind::Logits) {
        source = prefix_source(s, a->params, plan.n_keep, a->timings);
        if (source >= 0) {
            if (!copy_slot(slots_[size_t(source)], s)) source = -1;  // `s` is empty now
            plan = plan_reuse(memory_view(s), prompt, true);
        }
    }

    // Carry the plan out; anything llama.cpp refuses falls back to a clean re-prefill.
    bool ok = true;
    if (plan.clear) {
        clear_slot_memory(s);
    } else {
        if (plan.checkpoint >= 0 && !s.checkpoints[size_t(plan.checkpoint)].state.empty()) {
            const auto & c = s.checkpoints[size_t(plan.checkpoint)];
            ok = llama_state_seq_set_data_ext(ctx_.get(), c.state.data(), c.state.size(), s.id,
                                              LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) == c.state.size();
            if (!ok) bump("checkpoint_restore_failures");
        }
        if (ok && plan.trim) {
            ok = llama_memory_seq_rm(mem, s.id, plan.n_keep, -1);
            if (!ok) bump("trim_failures");
        }
        if (ok) {
            std::vector<float> logits;
            if (plan.logits_from_slot) logits = s.last_logits;
            if (plan.logits_from_checkpoint) {
                const auto & lg = s.checkpoints[size_t(plan.checkpoint)].logits;
                logits.assign(lg.data(), lg.data() + lg.size());
            }
            s.tokens.resize(size_t(plan.n_keep));
            auto & ck = s.checkpoints;
            ck.erase(std::remove_if(ck.begin(), ck.end(),
                                    [&](const Checkpoint & c) { return c.n_tokens > plan.keep_checkpoints_upto; }),
                     ck.end());
            s.last_logits = std::move(logits);
        } else {
            clear_slot_memory(s);
            plan = ReusePlan{};
        }
    }
    if (plan.n_keep == 0) plan.kind = ReuseKind::None;
    s.restored = false;

    a->timings.cache_n = plan.n_keep;
    a->timings.reuse = reuse_kind_name(plan.kind);
    a->timings.restored = was_restored && source < 0;
    a->timings.source_slot = source;
    a->cursor = size_t(plan.n_keep);
    bump("requests");
    bump(std::string("prompt_tokens_reused_") + reuse_kind_name(plan.kind), plan.n_keep);
    if (source >= 0) bump("prompt_tokens_reused_prefix", plan.n_keep);
    if (was_restored && source < 0) {
        bump("prompt_tokens_reused_after_restore", plan.n_keep);
        if (plan.n_keep == 0 && restored_tokens > 0) bump("restores_reprefilled");
    }

    if (cfg_.max_checkpoints > 0 && plan.n_keep < L) {
        std::vector<int64_t> existing;
        for (const auto & c : s.checkpoints) existing.push_back(c.n_tokens);
        if (model().has_partial_state()) {
            a->plan = plan_checkpoints(plan.n_keep, L, a->params.checkpoint_hints, cfg_.checkpoint_interval,
                                       cfg_.checkpoint_min_step, existing);
        } else {
            // Attention KV trims to any position; only the prompt end's logits are worth keeping.
            a->plan = plan_checkpoints(plan.n_keep, L, {}, 0, cfg_.checkpoint_min_step, existing);
        }
    }
    a->sampler->prime(prompt);
    s.owner = a->params.owner;
    s.active = std::move(a);
    s.prompt_n = L;
    report_progress(s);

    if (plan.n_keep == L) {  // identical prompt: nothing to evaluate
        s.active->t_prompt_done = now_s();
        s.active->timings.prompt_ms = ms_since(s.active->t_start);
        s.active->generating = true;
        if (s.active->params.n_predict == 0) {
            finish(s, "length");
            return;
        }
        after_token(s, s.last_logits.data());
    }
}

bool Engine::step() {
    batch_.n_tokens = 0;
    auto add = [&](llama_token t, llama_pos pos, llama_seq_id seq, bool logits) {
        const int i = batch_.n_tokens++;
        batch_.token[i] = t;
        batch_.pos[i] = pos;
        batch_.n_seq_id[i] = 1;
        batch_.seq_id[i][0] = seq;
        batch_.logits[i] = logits ? 1 : 0;
        return i;
    };
    int budget = cfg_.n_batch;
    // Decode tokens first: one per generating slot keeps latency flat while others prefill.
    for (auto & s : slots_) {
        if (!s.active || !s.active->generating) continue;
        s.active->batch_index = add(s.active->pending, llama_pos(s.tokens.size()), s.id, true);
        budget--;
    }
    for (auto & s : slots_) {
        if (budget <= 0) break;
        if (!s.active || s.active->generating) continue;
        Active & a = *s.active;
        size_t end = std::min(a.params.prompt.size(), a.cursor + size_t(budget));
        // A chunk ends exactly at the next planned checkpoint so the state can be captured there.
        for (const auto & c : a.plan) {
            if (size_t(c.n_tokens) > a.cursor) {
                end = std::min(end, size_t(c.n_tokens));
                break;
            }
        }
        for (size_t i = a.cursor; i < end; i++) {
            a.batch_index = add(a.params.prompt[i], llama_pos(i), s.id, i + 1 == end);
        }
        a.chunk_end = end;
        budget -= int(end - a.cursor);
    }
    if (batch_.n_tokens == 0) return false;

    const int rc = llama_decode(ctx_.get(), batch_);
    if (rc == 1 && cfg_.kv_unified) {
        // No room for this batch in the shared pool. llama.cpp placed nothing (it plans every
        // ubatch before computing any), so every slot is as it was: free some cells and let the
        // next iteration build the batch again.
        bump("kv_pool_full");
        for (auto & s : slots_) {
            if (s.active) s.active->batch_index = -1;
        }
        make_room_in_pool();
        return true;
    }
    if (rc != 0) {
        bump("decode_errors");
        for (auto & s : slots_) {
            if (s.active && s.active->batch_index >= 0) {
                fail_slot(s, "llama_decode failed with code " + std::to_string(rc));
            }
        }
        return true;
    }
    for (auto & s : slots_) {
        if (!s.active || s.active->batch_index < 0) continue;
        Active & a = *s.active;
        const float * logits = llama_get_logits_ith(ctx_.get(), a.batch_index);
        a.batch_index = -1;
        if (a.generating) {
            s.tokens.push_back(a.pending);
            s.last_logits.assign(logits, logits + n_vocab_);
            after_token(s, logits);
            continue;
        }
        const auto & prompt = a.params.prompt;
        s.tokens.insert(s.tokens.end(), prompt.begin() + long(a.cursor), prompt.begin() + long(a.chunk_end));
        a.timings.prompt_n += int(a.chunk_end - a.cursor);
        bump("prompt_tokens_evaluated", int64_t(a.chunk_end - a.cursor));
        a.cursor = a.chunk_end;
        s.last_logits.assign(logits, logits + n_vocab_);
        while (!a.plan.empty() && size_t(a.plan.front().n_tokens) <= a.cursor) {
            if (size_t(a.plan.front().n_tokens) == a.cursor) capture_checkpoint(s, a.plan.front().kind, logits);
            a.plan.erase(a.plan.begin());
        }
        const bool prompt_done = a.cursor == prompt.size();
        if (prompt_done) {
            a.t_prompt_done = now_s();
            a.timings.prompt_ms = ms_since(a.t_start);
        }
        report_progress(s);
        if (prompt_done) {
            a.generating = true;
            if (a.params.n_predict == 0) {
                finish(s, "length");
                continue;
            }
            after_token(s, logits);
        }
    }
    return true;
}

void Engine::after_token(Slot & s, const float * logits) {
    Active & a = *s.active;
    llama_token t;
    try {
        t = a.sampler->sample(logits);
    } catch (const std::exception & e) {
        fail_slot(s, e.what());
        return;
    }
    a.n_sampled++;
    bump("tokens_generated");
    if (!a.params.ignore_eos && llama_vocab_is_eog(model_.vocab(), t)) {
        finish(s, "eos");
        return;
    }
    if (std::find(a.params.stop_tokens.begin(), a.params.stop_tokens.end(), t) != a.params.stop_tokens.end()) {
        finish(s, "stop_token");
        return;
    }
    Event e;
    e.request_id = a.id;
    e.kind = "token";
    e.token = t;
    e.piece = token_piece(t, false);
    e.slot = s.id;
    if (a.params.n_probs > 0) token_probs(logits, t, a.params.n_probs, e);
    if (a.params.timings_per_token) {
        e.timings = timings_so_far(s);
        e.timings.predicted_n = a.n_sampled;  // this token included
    }
    const bool stopped = completes_stop_string(a, t, e.piece);
    push_event(std::move(e));
    if (stopped) {
        finish(s, "stop_word");
    } else if (a.params.n_predict >= 0 && a.n_sampled >= a.params.n_predict) {
        finish(s, "length");
    } else if (int(s.tokens.size()) + 1 >= n_ctx_slot_ && !(cfg_.context_shift && shift_context(s))) {
        finish(s, "context");
    } else {
        a.pending = t;
    }
}

bool Engine::completes_stop_string(Active & a, llama_token t, const std::string & piece) const {
    if (a.params.stop_strings.empty()) return false;
    const auto & keep = a.params.preserved_tokens;
    a.stop_tail += std::find(keep.begin(), keep.end(), t) != keep.end() ? token_piece(t, true) : piece;
    size_t longest = 0;
    for (const auto & stop : a.params.stop_strings) {
        if (!stop.empty() && a.stop_tail.find(stop) != std::string::npos) return true;
        longest = std::max(longest, stop.size());
    }
    // Only the last longest-1 bytes can still begin a stop string that later pieces complete.
    if (longest > 0 && a.stop_tail.size() >= longest) a.stop_tail.erase(0, a.stop_tail.size() - (longest - 1));
    return false;
}

// llama-server's probabilities without post_sampling_probs: a softmax over the raw logits of the
// position (before bias, penalties and grammar), the sampled token's and the n most probable.
// Only requests that ask pay for it: O(n_vocab) plus a partial sort of n entries.
void Engine::token_probs(const float * logits, llama_token sampled, int n_probs, Event & e) {
    const int V = n_vocab_;
    float mx = logits[0];
    for (int i = 1; i < V; i++) mx = std::max(mx, logits[i]);
    double sum = 0.0;
    for (int i = 0; i < V; i++) sum += std::exp(double(logits[i]) - double(mx));
    const double lse = double(mx) + std::log(sum);
    e.logprob = float(double(logits[sampled]) - lse);
    const int k = std::min(n_probs, V);
    prob_order_.resize(size_t(V));
    for (int i = 0; i < V; i++) prob_order_[size_t(i)] = i;
    std::partial_sort(prob_order_.begin(), prob_order_.begin() + k, prob_order_.end(), [logits](int x, int y) {
        return logits[x] > logits[y] || (logits[x] == logits[y] && x < y);
    });
    e.top_logprobs.reserve(size_t(k));
    for (int i = 0; i < k; i++) {
        const int id = prob_order_[size_t(i)];
        e.top_logprobs.emplace_back(id, float(double(logits[id]) - lse));
    }
}

// The request's timings as of now: the prompt's time until it was done (or so far), the
// generation's since then.
Timings Engine::timings_so_far(const Slot & s) const {
    const Active & a = *s.active;
    Timings t = a.timings;
    t.predicted_n = a.n_sampled;
    if (a.t_prompt_done > 0) t.predicted_ms = ms_since(a.t_prompt_done);
    else t.prompt_ms = ms_since(a.t_start);
    return t;
}

// llama-server's prompt progress (`return_progress`): one event when the request starts, with what
// was reused, and one after every prompt chunk evaluated. Sent before the token its last chunk
// samples, so a stream shows the progress reach the prompt's end before the first token.
void Engine::report_progress(Slot & s) {
    const Active & a = *s.active;
    if (!a.params.report_progress) return;
    Event e;
    e.request_id = a.id;
    e.kind = "progress";
    e.slot = s.id;
    e.timings = timings_so_far(s);
    e.elapsed_ms = ms_since(a.t_start);
    if (e.timings.prompt_n == 0 && a.t_prompt_done == 0) e.timings.prompt_ms = 0.0;
    e.prompt_total = int(a.params.prompt.size());
    push_event(std::move(e));
}

void Engine::finish(Slot & s, const std::string & reason) {
    Active & a = *s.active;
    Event e;
    e.request_id = a.id;
    e.kind = "done";
    e.stop_reason = reason;
    e.slot = s.id;
    e.timings = timings_so_far(s);
    s.active.reset();
    s.last_used = now_s();
    push_event(std::move(e));
}

void Engine::fail_slot(Slot & s, const std::string & message) {
    Event e = error_event(s.active->id, s.id, message);
    e.timings = s.active->timings;
    s.active.reset();
    // The sequence may be half-updated: start it over.
    clear_slot_memory(s);
    s.last_used = now_s();
    push_event(std::move(e));
}

}  // namespace sk

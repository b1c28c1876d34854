// The Python surface of the native core (typed in native/_native.pyi). Every call that waits for the
// loop thread, touches files or loads a model releases the GIL: they take from microseconds (a
// loop step in flight) to seconds (model load, multi-GB slot files).
#include "chat.h"
#include "engine.h"
#include "errors.h"
#include "hash.h"
#include "model.h"
#include "reuse.h"

#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdio>

namespace py = pybind11;
using namespace sk;

namespace {

// llama.cpp logs everything to stderr by default; keep warnings and errors only.
void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

[[noreturn]] void raise_py(py::object instance) {
    PyErr_SetObject(reinterpret_cast<PyObject *>(Py_TYPE(instance.ptr())), instance.ptr());
    throw py::error_already_set();
}

py::object error_class(const char * name) { return py::module_::import("native.errors").attr(name); }

}  // namespace

PYBIND11_MODULE(_native, m) {
    m.doc() = "Slotkeeper's native core over libllama (see native/_native.pyi)";
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();

    m.attr("STATE_SEQ_VERSION") = LLAMA_STATE_SEQ_VERSION;
    m.attr("LLAMA_BUILD") = SK_LLAMA_BUILD;
    m.attr("ENGINE_VERSION") = SK_ENGINE_VERSION;
    m.attr("MAX_N_PROBS") = kMaxProbs;
    m.attr("KV_CACHE_TYPES") = py::tuple(py::cast(kv_cache_type_names()));

    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const SlotFileError & e) {
            raise_py(error_class("SlotFileError")(e.kind, e.what()));
        } catch (const SlotBusyError & e) {
            raise_py(error_class("SlotBusyError")(e.what()));
        } catch (const InvalidRequestError & e) {
            raise_py(error_class("InvalidRequestError")(e.what()));
        } catch (const EngineClosedError & e) {
            raise_py(error_class("EngineClosedError")(e.what()));
        } catch (const ModelLoadError & e) {
            raise_py(error_class("ModelLoadError")(e.what()));
        } catch (const NativeError & e) {
            raise_py(error_class("NativeError")(e.what()));
        }
    });

    py::class_<ModelInfo>(m, "ModelInfo")
        .def_readonly("path", &ModelInfo::path)
        .def_readonly("arch", &ModelInfo::arch)
        .def_readonly("description", &ModelInfo::description)
        .def_readonly("n_vocab", &ModelInfo::n_vocab)
        .def_readonly("n_ctx_train", &ModelInfo::n_ctx_train)
        .def_readonly("n_embd", &ModelInfo::n_embd)
        .def_readonly("n_layer", &ModelInfo::n_layer)
        .def_readonly("n_params", &ModelInfo::n_params)
        .def_readonly("size_bytes", &ModelInfo::size_bytes)
        .def_readonly("recurrent", &ModelInfo::recurrent)
        .def_readonly("hybrid", &ModelInfo::hybrid)
        .def_readonly("n_swa", &ModelInfo::n_swa)
        .def_readonly("chat_template", &ModelInfo::chat_template)
        .def_readonly("bos", &ModelInfo::bos)
        .def_readonly("eos", &ModelInfo::eos)
        .def_readonly("eot", &ModelInfo::eot)
        .def_readonly("add_bos", &ModelInfo::add_bos)
        .def_readonly("fingerprint", &ModelInfo::fingerprint)
        .def_readonly("meta", &ModelInfo::meta);

    // The keyword defaults are EngineConfig's own (engine_config.h), read off a default one.
    const EngineConfig defaults;
    py::class_<EngineConfig>(m, "EngineConfig")
        .def(py::init([](std::string model_path, int n_slots, int n_ctx, int n_batch, int n_ubatch, int n_threads,
                         int n_gpu_layers, int checkpoint_interval, int checkpoint_min_step, int max_checkpoints,
                         uint64_t max_checkpoint_bytes, int max_stored_checkpoints,
                         uint64_t max_stored_checkpoint_bytes, uint64_t max_slot_file_bytes, bool swa_full,
                         bool flash_attn, bool repack, bool kv_unified, std::string cache_type_k,
                         std::string cache_type_v, bool use_mmap, bool use_mlock, bool warmup, bool context_shift) {
                 EngineConfig c;
                 c.model = ModelLoad{std::move(model_path), n_gpu_layers, repack, use_mmap, use_mlock};
                 c.n_slots = n_slots;
                 c.n_ctx = n_ctx;
                 c.n_batch = n_batch;
                 c.n_ubatch = n_ubatch;
                 c.n_threads = n_threads;
                 c.checkpoint_interval = checkpoint_interval;
                 c.checkpoint_min_step = checkpoint_min_step;
                 c.max_checkpoints = max_checkpoints;
                 c.max_checkpoint_bytes = max_checkpoint_bytes;
                 c.max_stored_checkpoints = max_stored_checkpoints;
                 c.max_stored_checkpoint_bytes = max_stored_checkpoint_bytes;
                 c.max_slot_file_bytes = max_slot_file_bytes;
                 c.swa_full = swa_full;
                 c.flash_attn = flash_attn;
                 c.kv_unified = kv_unified;
                 c.cache_type_k = std::move(cache_type_k);
                 c.cache_type_v = std::move(cache_type_v);
                 c.warmup = warmup;
                 c.context_shift = context_shift;
                 return c;
             }),
             py::arg("model_path"), py::kw_only(), py::arg("n_slots") = defaults.n_slots,
             py::arg("n_ctx") = defaults.n_ctx, py::arg("n_batch") = defaults.n_batch,
             py::arg("n_ubatch") = defaults.n_ubatch, py::arg("n_threads") = defaults.n_threads,
             py::arg("n_gpu_layers") = defaults.model.n_gpu_layers,
             py::arg("checkpoint_interval") = defaults.checkpoint_interval,
             py::arg("checkpoint_min_step") = defaults.checkpoint_min_step,
             py::arg("max_checkpoints") = defaults.max_checkpoints,
             py::arg("max_checkpoint_bytes") = defaults.max_checkpoint_bytes,
             py::arg("max_stored_checkpoints") = defaults.max_stored_checkpoints,
             py::arg("max_stored_checkpoint_bytes") = defaults.max_stored_checkpoint_bytes,
             py::arg("max_slot_file_bytes") = defaults.max_slot_file_bytes, py::arg("swa_full") = defaults.swa_full,
             py::arg("flash_attn") = defaults.flash_attn, py::arg("repack") = defaults.model.repack,
             py::arg("kv_unified") = defaults.kv_unified, py::arg("cache_type_k") = defaults.cache_type_k,
             py::arg("cache_type_v") = defaults.cache_type_v, py::arg("use_mmap") = defaults.model.use_mmap,
             py::arg("use_mlock") = defaults.model.use_mlock, py::arg("warmup") = defaults.warmup,
             py::arg("context_shift") = defaults.context_shift)
        // Read-only: a configuration is built once by the constructor above; the engine keeps its own
        // copy (Engine.config hands out another), so nothing in Python can reach the running one.
        .def_property_readonly("model_path", [](const EngineConfig & c) { return c.model.path; })
        .def_readonly("n_slots", &EngineConfig::n_slots)
        .def_readonly("n_ctx", &EngineConfig::n_ctx)
        .def_readonly("n_batch", &EngineConfig::n_batch)
        .def_readonly("n_ubatch", &EngineConfig::n_ubatch)
        .def_readonly("n_threads", &EngineConfig::n_threads)
        .def_property_readonly("n_gpu_layers", [](const EngineConfig & c) { return c.model.n_gpu_layers; })
        .def_readonly("checkpoint_interval", &EngineConfig::checkpoint_interval)
        .def_readonly("checkpoint_min_step", &EngineConfig::checkpoint_min_step)
        .def_readonly("max_checkpoints", &EngineConfig::max_checkpoints)
        .def_readonly("max_checkpoint_bytes", &EngineConfig::max_checkpoint_bytes)
        .def_readonly("max_stored_checkpoints", &EngineConfig::max_stored_checkpoints)
        .def_readonly("max_stored_checkpoint_bytes", &EngineConfig::max_stored_checkpoint_bytes)
        .def_readonly("max_slot_file_bytes", &EngineConfig::max_slot_file_bytes)
        .def_readonly("swa_full", &EngineConfig::swa_full)
        .def_readonly("flash_attn", &EngineConfig::flash_attn)
        .def_property_readonly("repack", [](const EngineConfig & c) { return c.model.repack; })
        .def_readonly("kv_unified", &EngineConfig::kv_unified)
        .def_readonly("cache_type_k", &EngineConfig::cache_type_k)
        .def_readonly("cache_type_v", &EngineConfig::cache_type_v)
        .def_property_readonly("use_mmap", [](const EngineConfig & c) { return c.model.use_mmap; })
        .def_property_readonly("use_mlock", [](const EngineConfig & c) { return c.model.use_mlock; })
        .def_readonly("warmup", &EngineConfig::warmup)
        .def_readonly("context_shift", &EngineConfig::context_shift);

    py::class_<RequestParams>(m, "RequestParams")
        .def(py::init([](std::vector<llama_token> prompt) {
                 RequestParams p;
                 p.prompt = std::move(prompt);
                 return p;
             }),
             py::arg("prompt") = std::vector<llama_token>{})
        .def_readwrite("prompt", &RequestParams::prompt)
        .def_readwrite("n_predict", &RequestParams::n_predict)
        .def_readwrite("temperature", &RequestParams::temperature)
        .def_readwrite("top_k", &RequestParams::top_k)
        .def_readwrite("top_p", &RequestParams::top_p)
        .def_readwrite("min_p", &RequestParams::min_p)
        .def_readwrite("seed", &RequestParams::seed)
        .def_readwrite("repeat_penalty", &RequestParams::repeat_penalty)
        .def_readwrite("repeat_last_n", &RequestParams::repeat_last_n)
        .def_readwrite("presence_penalty", &RequestParams::presence_penalty)
        .def_readwrite("frequency_penalty", &RequestParams::frequency_penalty)
        .def_readwrite("logit_bias", &RequestParams::logit_bias)
        .def_readwrite("stop_tokens", &RequestParams::stop_tokens)
        .def_readwrite("stop_strings", &RequestParams::stop_strings)
        .def_readwrite("preserved_tokens", &RequestParams::preserved_tokens)
        .def_readwrite("ignore_eos", &RequestParams::ignore_eos)
        .def_readwrite("grammar", &RequestParams::grammar)
        .def_readwrite("grammar_lazy", &RequestParams::grammar_lazy)
        .def_readwrite("grammar_trigger_patterns", &RequestParams::grammar_trigger_patterns)
        .def_readwrite("grammar_trigger_tokens", &RequestParams::grammar_trigger_tokens)
        .def_readwrite("grammar_prefill", &RequestParams::grammar_prefill)
        .def_readwrite("checkpoint_hints", &RequestParams::checkpoint_hints)
        .def_readwrite("cache_prompt", &RequestParams::cache_prompt)
        .def_readwrite("prefix_sources", &RequestParams::prefix_sources)
        .def_readwrite("owner", &RequestParams::owner)
        .def_readwrite("n_probs", &RequestParams::n_probs)
        .def_readwrite("n_keep", &RequestParams::n_keep)
        .def_readwrite("n_discard", &RequestParams::n_discard)
        .def_readwrite("report_progress", &RequestParams::report_progress)
        .def_readwrite("timings_per_token", &RequestParams::timings_per_token);

    py::class_<Timings>(m, "Timings")
        .def_readonly("prompt_n", &Timings::prompt_n)
        .def_readonly("cache_n", &Timings::cache_n)
        .def_readonly("predicted_n", &Timings::predicted_n)
        .def_readonly("prompt_ms", &Timings::prompt_ms)
        .def_readonly("predicted_ms", &Timings::predicted_ms)
        .def_readonly("reuse", &Timings::reuse)
        .def_readonly("restored", &Timings::restored)
        .def_readonly("source_slot", &Timings::source_slot)
        .def_readonly("candidate_slot", &Timings::candidate_slot)
        .def_readonly("candidate_n", &Timings::candidate_n)
        .def_readonly("candidate_prompt_n", &Timings::candidate_prompt_n)
        .def_readonly("common_n", &Timings::common_n)
        .def_readonly("checkpoints_created", &Timings::checkpoints_created)
        .def_readonly("context_shifts", &Timings::context_shifts)
        .def("__repr__", [](const Timings & t) {
            return "Timings(prompt_n=" + std::to_string(t.prompt_n) + ", cache_n=" + std::to_string(t.cache_n) +
                   ", predicted_n=" + std::to_string(t.predicted_n) + ", reuse='" + t.reuse +
                   "', restored=" + (t.restored ? "True" : "False") + ")";
        });

    py::class_<Event>(m, "Event")
        .def_readonly("request_id", &Event::request_id)
        .def_readonly("kind", &Event::kind)
        .def_readonly("token", &Event::token)
        .def_property_readonly("piece", [](const Event & e) { return py::bytes(e.piece); })
        .def_readonly("stop_reason", &Event::stop_reason)
        .def_readonly("timings", &Event::timings)
        .def_readonly("message", &Event::message)
        .def_readonly("slot", &Event::slot)
        .def_readonly("logprob", &Event::logprob)
        .def_readonly("top_logprobs", &Event::top_logprobs)
        .def_readonly("prompt_total", &Event::prompt_total)
        .def_readonly("elapsed_ms", &Event::elapsed_ms)
        .def("__repr__", [](const Event & e) {
            return "Event(request_id=" + std::to_string(e.request_id) + ", kind='" + e.kind + "', token=" +
                   std::to_string(e.token) + ", stop_reason='" + e.stop_reason + "')";
        });

    py::class_<SlotFileInfo>(m, "SlotFileInfo")
        .def_readonly("path", &SlotFileInfo::path)
        .def_readonly("n_tokens", &SlotFileInfo::n_tokens)
        .def_readonly("n_bytes", &SlotFileInfo::n_bytes)
        .def_readonly("n_checkpoints", &SlotFileInfo::n_checkpoints)
        .def_readonly("ms", &SlotFileInfo::ms);

    py::class_<SlotSnapshot, std::shared_ptr<SlotSnapshot>>(m, "SlotSnapshot")
        .def_readonly("slot", &SlotSnapshot::slot)
        .def_property_readonly("n_tokens", [](const SlotSnapshot & s) { return int(s.tokens.size()); });

    py::class_<SlotInfo>(m, "SlotInfo")
        .def_readonly("id", &SlotInfo::id)
        .def_readonly("busy", &SlotInfo::busy)
        .def_readonly("request_id", &SlotInfo::request_id)
        .def_readonly("queued", &SlotInfo::queued)
        .def_readonly("n_tokens", &SlotInfo::n_tokens)
        .def_readonly("n_checkpoints", &SlotInfo::n_checkpoints)
        .def_readonly("checkpoint_bytes", &SlotInfo::checkpoint_bytes)
        .def_readonly("restored", &SlotInfo::restored)
        .def_readonly("last_used", &SlotInfo::last_used);

    using rel = py::call_guard<py::gil_scoped_release>;
    py::class_<Engine>(m, "Engine")
        // The callable runs on the loading thread with the GIL taken (pybind11's std::function
        // wrapper acquires it); the load itself runs without it.
        .def(py::init<const EngineConfig &, const LoadProgress &>(), py::arg("config"),
             py::arg("on_load_progress") = LoadProgress{}, rel())
        .def_property_readonly("model", &Engine::model, py::return_value_policy::reference_internal)
        // A copy: the loop and every thread read the engine's configuration without a lock (a
        // writable reference let `config.n_slots = 99` admit slot ids past the end of slots_).
        .def_property_readonly("config", [](const Engine & e) { return EngineConfig(e.config()); })
        .def_property_readonly("n_ctx_slot", &Engine::n_ctx_slot)
        .def_property_readonly("kv_streams", &Engine::kv_streams)
        // Tokenizing takes time in proportion to the text, far past the GIL budget for a long prompt:
        // without the GIL, so that the engine's event loop keeps serving while a worker thread tokenizes (the vocab is read-only).
        .def("tokenize", &Engine::tokenize, py::arg("text"), py::arg("add_special") = true,
             py::arg("parse_special") = true, rel())
        // Bytes, not str: a token may hold part of a UTF-8 sequence (the caller decodes, replacing).
        .def("detokenize",
             [](const Engine & e, const std::vector<llama_token> & tokens, bool remove_special, bool unparse_special) {
                 std::string text;
                 {
                     py::gil_scoped_release nogil;
                     text = e.detokenize(tokens, remove_special, unparse_special);
                 }
                 return py::bytes(text);
             },
             py::arg("tokens"), py::arg("remove_special") = false, py::arg("unparse_special") = true)
        .def("token_piece", [](const Engine & e, llama_token t, bool special) { return py::bytes(e.token_piece(t, special)); },
             py::arg("token"), py::arg("special") = true)
        .def("submit", &Engine::submit, py::arg("slot"), py::arg("params"))
        .def("cancel", &Engine::cancel, py::arg("request_id"), rel())
        .def("cancel_nowait", &Engine::cancel_nowait, py::arg("request_id"))
        .def("poll", &Engine::poll)
        .def("wait", &Engine::wait, py::arg("timeout_s"), rel())
        .def("event_fd", &Engine::event_fd)
        .def("save_slot", &Engine::save_slot, py::arg("slot"), py::arg("path"), rel())
        .def("snapshot_slot", &Engine::snapshot_slot, py::arg("slot"), rel())
        .def("write_snapshot", &Engine::write_snapshot, py::arg("snapshot"), py::arg("path"),
             py::arg("durable") = true, rel())
        .def("restore_slot", &Engine::restore_slot, py::arg("slot"), py::arg("path"), rel())
        .def("erase_slot", &Engine::erase_slot, py::arg("slot"), rel())
        .def("slots", &Engine::slots, rel())
        .def("slot_tokens", &Engine::slot_tokens, py::arg("slot"), rel())
        .def("metrics", &Engine::metrics, rel())
        .def("close", &Engine::close, rel())
        // Both take cmd_mu_, which the loop only holds for a queue swap: no GIL release needed.
        .def_property_readonly("closed", &Engine::closed)
        .def_property_readonly("fault", &Engine::fault)
        .def("_inject_fault_for_tests", &Engine::inject_fault_for_tests, py::arg("where") = "command");

    // Rendering and parsing are pure CPU work over client-sized text (the autoparser renders several
    // probe conversations per apply): release the GIL so the event loop's threads keep serving.
    py::class_<ChatLayer>(m, "ChatLayer")
        .def(py::init<const std::string &, const std::string &, const std::string &>(), py::arg("source"),
             py::arg("bos") = "", py::arg("eos") = "", rel())
        .def("apply", &ChatLayer::apply, py::arg("request"), rel());
    py::class_<ChatParser>(m, "ChatParser")
        .def(py::init<const std::string &, const std::string &, const std::string &, const std::string &, bool>(),
             py::arg("format"), py::arg("parser"), py::arg("generation_prompt"), py::arg("reasoning_format"),
             py::arg("parse_tool_calls") = true)
        .def("parse", &ChatParser::parse, py::arg("text"), py::arg("partial"), rel());

    m.def("read_fingerprint", &model_fingerprint, py::arg("model_path"), rel());
    // The ladder's pure choice (reuse.h), for tests: (n_tokens, kind name, bytes) ascending.
    m.def("checkpoints_to_evict", [](const std::vector<std::tuple<int64_t, std::string, size_t>> & ladder,
                                     size_t max_count, size_t max_bytes) {
        std::vector<CheckpointBudgetItem> items;
        for (const auto & [n, kind, bytes] : ladder) items.push_back({n, checkpoint_kind_from_name(kind), bytes});
        return checkpoints_to_evict(items, max_count, max_bytes);
    }, py::arg("ladder"), py::arg("max_count"), py::arg("max_bytes"));
    m.def("crc32", [](py::bytes data, uint32_t value) {
        std::string_view v = data;
        return crc32_update(value, v.data(), v.size());
    }, py::arg("data"), py::arg("value") = 0);
    m.def("crc32_portable", [](py::bytes data, uint32_t value) {
        std::string_view v = data;
        return crc32_portable(value, v.data(), v.size());
    }, py::arg("data"), py::arg("value") = 0);
}

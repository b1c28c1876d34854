"""The engine's command line: llama-server's flags as one table, `FLAGS`, that maps every flag to its
settings field (engine_pool.server.settings), its SLOTKEEPER_* variable, its default and its check
(command line > environment > default). The variable is SLOTKEEPER_ + the long flag's name, as
llama-server's LLAMA_ARG_* (`--parallel` → SLOTKEEPER_PARALLEL). Limits the gateway shares are rows of
`engine_pool.process.limit_flags`. `SWITCHES_OFF` adds the other half of llama-server's `--x/--no-x`
pairs. Flags keep llama-server's names and meanings, so a command line written for llama-server starts
this engine unchanged as long as it uses the common flags; anything unknown is refused with a clear
message rather than silently ignored. Lists (`--alias`, `--tags`, `--host`, `--cors-origins`) are
comma-separated, as there.
"""

from __future__ import annotations

import native
from engine_pool.process.flags import (
    LOG_FORMAT,
    LOG_LEVEL,
    NO_DEFAULT,
    Flag,
    at_least,
    bool_flag,
    bytes_flag,
    flag,
    float_flag,
    int_flag,
    one_of,
    str_flag,
    switch,
    within,
)
from engine_pool.process.limit_flags import BODY_TIMEOUT_S, MAX_BODY_BYTES, MAX_JSON_DEPTH, MAX_MESSAGES

from ..protocol.handoff import ROLES
from .formats import CHAT_FORMATS
from .formats.output import REASONING_FORMATS
from .grammar import GrammarLimits


def csv_list(text: str) -> tuple[str, ...]:
    """A comma-separated list: items stripped, empty ones dropped, duplicates kept once (first place)."""
    return tuple(dict.fromkeys(p for p in (s.strip() for s in text.split(",")) if p))


# llama-server's `-ctk/-ctv` values (common/arg.cpp's kv_cache_types).
CACHE_TYPES = native.KV_CACHE_TYPES  # llama-server's names, as the core accepts them


_CACHE_TYPE_LIST = ", ".join(CACHE_TYPES)


def _cache_type(text: str) -> str:
    if text not in CACHE_TYPES:
        raise ValueError(f"allowed values: {_CACHE_TYPE_LIST}")
    return text


def _threads(text: str) -> int:
    n = int(text)
    return 0 if n < 0 else n  # llama-server's -1 (auto) is the core's 0


_SCHEMA = GrammarLimits()  # the schema-grammar bounds' defaults live with the grammar builder

_POSITIVE = (lambda v: v >= 1, "positive")

FLAGS: tuple[Flag, ...] = (
    flag("model", "-m --model", NO_DEFAULT, "GGUF model file", required=True),
    str_flag(
        "host",
        "--host",
        "127.0.0.1",
        "addresses to listen on, comma-separated; one ending in .sock is a UNIX socket path; with several "
        "TCP addresses :: binds IPv6 only (127.0.0.1)",
        (lambda v: bool(csv_list(v)), "one or more addresses"),
    ),
    int_flag("port", "--port", 8080, "port to listen on (8080)", within(0, 65535)),
    int_flag("n_slots", "-np --parallel", 1, "number of slots (1)", within(1, 256)),
    int_flag(
        "n_ctx",
        "-c --ctx-size",
        4096,
        "total context (KV cells) shared by the slots; each slot gets ctx-size / parallel (4096)",
        (lambda v: v >= 16, "at least 16"),
    ),
    int_flag("n_batch", "-b --batch-size", 2048, "logical batch size (2048)", _POSITIVE),
    int_flag("n_ubatch", "-ub --ubatch-size", 512, "physical batch size (512)", _POSITIVE),
    flag("n_threads", "-t --threads", 0, "CPU threads (-1/0: all)", parse=_threads),
    int_flag("n_gpu_layers", "-ngl --n-gpu-layers --gpu-layers", 0, "layers to offload to the GPU (0)"),
    int_flag("seed", "-s --seed", -1, "default sampling seed (-1: random)"),
    float_flag("temperature", "--temp", 0.8, "default temperature (0.8)", at_least(0)),
    int_flag(
        "n_predict",
        "-n --n-predict",
        -1,
        "default tokens to predict (-1: until a stop or the slot's context is full)",
        at_least(-1),
    ),
    str_flag(
        "alias",
        "-a --alias",
        None,
        "model names, comma-separated, listed by /v1/models; the first is the model id (file name)",
    ),
    str_flag(
        "tags",
        "--tags",
        "",
        "model tags, comma-separated, listed by /v1/models (informational, never used to route)",
    ),
    str_flag(
        "slot_save_path",
        "--slot-save-path",
        None,
        "directory of slot files for /slots/{id}?action=save|restore (disabled without it)",
    ),
    int_flag(
        "max_checkpoints",
        "--ctx-checkpoints --swa-checkpoints",
        32,
        "checkpoints kept per slot (32; 0 disables them)",
        at_least(0),
    ),
    int_flag(
        "checkpoint_min_step",
        "--checkpoint-min-step",
        64,
        "minimum distance in tokens between checkpoints (64)",
        at_least(0),
    ),
    int_flag(
        "checkpoint_interval",
        "--checkpoint-interval",
        2048,
        "checkpoint every this many tokens inside long prompts (2048; 0: off)",
        at_least(0),
    ),
    bytes_flag(
        "max_checkpoint_bytes",
        "--max-checkpoint-bytes",
        1 << 30,
        "checkpoint memory per slot, e.g. 512M (1G)",
        at_least(0),
    ),
    int_flag(
        "max_stored_checkpoints",
        "--stored-checkpoints",
        8,
        "checkpoints a slot file keeps, spaced geometrically toward its end (8; 0: none)",
        at_least(0),
    ),
    bytes_flag(
        "max_stored_checkpoint_bytes",
        "--stored-checkpoint-bytes",
        512 << 20,
        "checkpoint bytes a slot file keeps, e.g. 256M (512M)",
        at_least(0),
    ),
    bytes_flag(
        "max_slot_file_bytes",
        "--max-slot-file-bytes",
        0,
        "refuse to restore larger slot files (0: no limit)",
        at_least(0),
    ),
    switch("swa_full", "--swa-full", "full-size SWA cache"),
    bool_flag("flash_attn", "-fa --flash-attn", False, "flash attention: on|off|auto"),
    str_flag("api_key", "--api-key", None, "require this key (Authorization: Bearer)"),
    int_flag(
        "queue_size",
        "--queue-size",
        16,
        "requests that may wait for a busy slot; more get 503 + Retry-After (16)",
        at_least(0),
    ),
    float_flag(
        "slot_wait_s",
        "--slot-wait-timeout",
        30.0,
        "seconds a slot save/restore/erase waits for a busy slot (30)",
        at_least(0),
    ),
    int_flag("retry_after_s", "--retry-after", 1, "Retry-After seconds on 503 responses (1)"),
    float_flag(
        "shutdown_grace_s",
        "--shutdown-grace",
        10.0,
        "seconds in-flight requests may finish after SIGTERM before they are aborted (10)",
        at_least(0),
    ),
    switch(
        "exit_with_parent",
        "--exit-with-parent",
        "stop (as on SIGTERM) when the process that started this one dies (Linux; set by the node agent)",
    ),
    str_flag(
        "instance_id",
        "--instance-id",
        None,
        "this process's name, new at every start (set by the node agent): a request naming another "
        "one in X-Slotkeeper-Instance is refused with 409 before it reaches a slot",
    ),
    LOG_FORMAT,
    LOG_LEVEL.with_help("debug, info, warning, error (info)"),
    switch(
        "verbose",
        "-v --log-verbose --verbose",
        "log everything: --log-level debug, plus every request and response body (first 64 KiB)",
        variable="SLOTKEEPER_VERBOSE",
    ),
    # -- llama-server's endpoints and its CORS ---------------------------------------------------------
    switch("metrics", "--metrics", "serve Prometheus metrics on /metrics (without it: 501, as llama-server)"),
    switch(
        "no_slots",
        "--no-slots",
        "answer GET /slots and POST /slots/{id} with 501 (--slots: serve them, the default)",
    ),
    str_flag(
        "cors_origins",
        "--cors-origins",
        None,
        "origins whose pages may call this API, comma-separated; * any (with credentials, the Origin is "
        "echoed), localhost only pages served from this machine (*; localhost with --ui-mcp-proxy)",
        (lambda v: v is None or bool(csv_list(v)), "*, localhost or one or more origins"),
    ),
    str_flag(
        "cors_methods",
        "--cors-methods",
        "GET, POST, DELETE, OPTIONS",
        "Access-Control-Allow-Methods of a preflight's answer (GET, POST, DELETE, OPTIONS)",
        (lambda v: bool(csv_list(v)), "one or more methods"),
    ),
    str_flag(
        "cors_headers",
        "--cors-headers",
        "*",
        "Access-Control-Allow-Headers of a preflight's answer (*; in a browser * never covers Authorization)",
    ),
    switch(
        "cors_credentials",
        "--cors-credentials",
        "allow credentialed requests; with --cors-origins * the Origin is echoed (on; --no-cors-credentials)",
        default=True,
    ),
    switch(
        "ui_mcp_proxy",
        "--ui-mcp-proxy --webui-mcp-proxy",
        "serve /cors-proxy?url=URL: forwards GET/POST to URL with only the x-llama-server-proxy-header-* "
        "headers; do not enable in untrusted environments (off: 403)",
    ),
    switch(
        "offline",
        "--offline",
        "accepted for llama-server command lines: this engine never downloads anything",
    ),
    # -- the model and its KV cache (llama-server's flags; wired in runtime.py) -------------------------
    switch(
        "kv_unified",
        "-kvu --kv-unified",
        "one KV buffer shared by all slots (-no-kvu/--no-kv-unified: off, the default)",
    ),
    flag(
        "cache_type_k",
        "-ctk --cache-type-k",
        "f16",
        f"KV cache type of K: {_CACHE_TYPE_LIST} (f16)",
        parse=_cache_type,
    ),
    flag(
        "cache_type_v",
        "-ctv --cache-type-v",
        "f16",
        f"KV cache type of V: {_CACHE_TYPE_LIST} (f16)",
        parse=_cache_type,
    ),
    switch(
        "no_mmap",
        "--no-mmap",
        "read the model into memory instead of mapping it (--mmap: map it, the default)",
    ),
    switch("mlock", "--mlock", "keep the model in RAM (no swap)"),
    switch("no_warmup", "--no-warmup", "skip the empty warm-up run at load (--warmup: run it, the default)"),
    switch(
        "context_shift",
        "--context-shift",
        "shift the context when a generation fills it (--no-context-shift: stop instead, the default)",
    ),
    # -- request limits (the gateway uses the same names for its own edge limits) --------------------
    MAX_BODY_BYTES.with_help("largest request body, e.g. 16M; larger ones get 413 (16M)"),
    MAX_JSON_DEPTH.with_help("deepest JSON nesting of a request body (64)"),
    BODY_TIMEOUT_S.with_help("seconds a client may take to send its request body; slower ones get 408 (60)"),
    MAX_MESSAGES.with_help("messages per request (4096)"),
    int_flag("max_tools", "--max-tools", 512, "tools per request (512)", at_least(0)),
    bytes_flag(
        "max_text_chars",
        "--max-text-chars",
        1 << 20,
        "characters of text in one request's messages or prompts, e.g. 4M (1M)",
        at_least(1),
    ),
    int_flag("max_stop", "--max-stop", 16, "stop strings per request (16)", at_least(0)),
    int_flag("max_stop_chars", "--max-stop-chars", 256, "characters per stop string (256)", at_least(1)),
    int_flag("max_logit_bias", "--max-logit-bias", 2048, "logit_bias entries (2048)", at_least(0)),
    bytes_flag(
        "max_grammar_bytes",
        "--max-grammar-bytes",
        64 << 10,
        "size of a request's raw GBNF `grammar` (64K)",
        at_least(0),
    ),
    # llama.cpp parses GBNF recursively (one C++ frame chain per parenthesis) on the event loop's
    # thread: a few thousand levels crash the process, so this bound is not the operator's to lift.
    int_flag(
        "max_grammar_depth",
        "--max-grammar-depth",
        64,
        "parenthesis nesting of a raw GBNF `grammar` (64; llama.cpp parses it recursively)",
        within(1, 1024),
    ),
    # The schema walk recurses in Python (a few frames per level, under the interpreter's 1000).
    int_flag(
        "max_schema_depth",
        "--max-schema-depth",
        _SCHEMA.max_depth,
        "nesting of a JSON schema (response_format, json_schema, tool parameters), $refs included (32)",
        within(1, 128),
    ),
    bytes_flag(
        "max_schema_grammar_bytes",
        "--max-schema-grammar-bytes",
        _SCHEMA.max_bytes,
        "size of the grammar built from a request's JSON schemas and tools (2M)",
        at_least(1024),
    ),
    int_flag(
        "max_schema_grammar_rules",
        "--max-schema-grammar-rules",
        _SCHEMA.max_rules,
        "rules in the grammar built from a request's JSON schemas and tools (32768)",
        at_least(16),
    ),
    str_flag(
        "chat_template",
        "--chat-template",
        None,
        "chat template: a built-in name (chatml, ...) or a jinja template; overrides the GGUF's",
    ),
    str_flag(
        "chat_template_file",
        "--chat-template-file",
        None,
        "read the chat template (jinja) from this file; overrides the GGUF's",
    ),
    switch(
        "no_repack",
        "-nr --no-repack",
        "no weight repacking (llama.cpp extra buffer types); always off for quantized models on CPUs "
        "with AMX",
    ),
    switch("jinja", "--jinja", "jinja chat templates (always on)", default=True),
    str_flag(
        "reasoning",
        "-rea --reasoning",
        "auto",
        "whether the model reasons: on, off (enable_thinking false for the template, and a reasoning "
        "block the prompt still opens is closed), auto: the template's default (auto)",
        one_of("on", "off", "auto"),
    ),
    str_flag(
        "reasoning_format",
        "--reasoning-format",
        "auto",
        "where reasoning goes: none (left in content), deepseek / auto (reasoning_content), "
        "deepseek-legacy (both) (auto)",
        (lambda v: v in REASONING_FORMATS, f"one of {', '.join(REASONING_FORMATS)}"),
    ),
    str_flag(
        "chat_format",
        "--chat-format",
        "auto",
        "tool-call format: auto (detected from the template: a family's own, else llama.cpp's chat "
        "layer), hermes, qwen-xml, lfm2, nemotron-h, llama.cpp (auto)",
        (lambda v: v in CHAT_FORMATS, f"one of {', '.join(CHAT_FORMATS)}"),
    ),
    str_flag(
        "role",
        "--role",
        "mixed",
        "this engine's part in a prefill/decode split: prefill, decode or mixed (mixed); shown in "
        "/v1/models and /metrics, read by the node agent that runs it",
        (lambda v: v in ROLES, f"one of {', '.join(ROLES)}"),
    ),
)


# llama-server's "--x, --no-x" pairs: the flags that turn a switch of `FLAGS` off again (the last one on
# the command line wins, as in llama-server).
SWITCHES_OFF: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("kv_unified", ("-no-kvu", "--no-kv-unified")),
    ("no_mmap", ("--mmap",)),
    ("no_warmup", ("--warmup",)),
    ("context_shift", ("--no-context-shift",)),
    ("no_slots", ("--slots",)),
    ("jinja", ("--no-jinja",)),  # accepted, logged: templates are always jinja here
    ("cors_credentials", ("--no-cors-credentials",)),
    ("ui_mcp_proxy", ("--no-ui-mcp-proxy", "--no-webui-mcp-proxy")),
)

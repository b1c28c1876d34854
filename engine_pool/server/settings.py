"""Settings of one engine process: llama-server's flags, their SLOTKEEPER_* variables, one frozen object.

`FLAGS` is the single table that maps every command-line flag to its settings field and its
environment variable (command line > environment > default); `SWITCHES_OFF` adds the other half of
llama-server's `--x/--no-x` pairs. `parse_settings(argv, environ)` is the only reader of the tables;
`engine_main` hands it `os.environ`, nothing else reads the environment. Flags keep llama-server's
names and meanings, so a command line written for llama-server starts this engine unchanged as long
as it uses the common flags; anything unknown is refused with a clear message rather than silently
ignored. Lists (`--alias`, `--tags`, `--host`, `--cors-origins`) are comma-separated, as there.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import native

from ..flags import (
    LOG_FORMAT,
    Check,
    Flag,
    SettingsError,
    check,
    defaults_of,
    parse_bool,
    parse_bytes,
    parse_int,
    values_from,
)
from ..flags import build_parser as _build_parser
from .formats import CHAT_FORMATS
from .formats.output import REASONING_FORMATS

__all__ = [
    "CACHE_TYPES",
    "FLAGS",
    "SWITCHES_OFF",
    "EngineSettings",
    "SettingsError",
    "build_parser",
    "describe",
    "parse_settings",
]


@dataclass(frozen=True)
class EngineSettings:
    """Everything one engine process is configured with. Built once, at the edge."""

    model: str
    host: str = "127.0.0.1"
    port: int = 8080
    n_slots: int = 1
    n_ctx: int = 4096
    n_batch: int = 2048
    n_ubatch: int = 512
    n_threads: int = 0
    n_gpu_layers: int = 0
    seed: int = -1
    temperature: float = 0.8
    n_predict: int = -1
    alias: str | None = None
    slot_save_path: str | None = None
    max_checkpoints: int = 32
    checkpoint_min_step: int = 64
    checkpoint_interval: int = 2048
    max_checkpoint_bytes: int = 1 << 30
    max_slot_file_bytes: int = 0
    swa_full: bool = False
    flash_attn: bool = False
    api_key: str | None = None
    queue_size: int = 16
    slot_wait_s: float = 30.0
    retry_after_s: int = 1
    shutdown_grace_s: float = 10.0
    exit_with_parent: bool = False
    instance_id: str | None = None
    log_format: str = "auto"  # console on a terminal, JSON lines otherwise
    log_level: str = "info"
    # What one request may ask (each refused with a precise 4xx naming the field and the limit; see
    # limits.py and DESIGN.md "Limits").
    max_body_bytes: int = 16 << 20
    max_json_depth: int = 64
    body_timeout_s: float = 60.0
    max_messages: int = 4096
    max_tools: int = 512
    max_text_chars: int = 1 << 20
    max_stop: int = 16
    max_stop_chars: int = 256
    max_logit_bias: int = 2048
    max_grammar_bytes: int = 64 << 10
    max_grammar_depth: int = 64
    max_schema_depth: int = 32
    max_schema_grammar_bytes: int = 2 << 20
    max_schema_grammar_rules: int = 32768
    # Chat templates and formats (llama-server's flags; see chat_template.py and formats/).
    chat_template: str | None = None  # a built-in template name or an inline jinja template
    chat_template_file: str | None = None
    jinja: bool = True  # accepted for llama-server command lines: templates are always jinja here
    reasoning_format: str = "auto"  # none | deepseek | deepseek-legacy | auto
    reasoning: str = "auto"  # on | off | auto: whether the model reasons (llama-server's --reasoning)
    chat_format: str = "auto"  # the tool-call format: auto (from the template), a family's or llama.cpp's
    no_repack: bool = False  # llama-server's --no-repack (also forced on CPUs with AMX: runtime.py)
    # llama-server drop-in flags (issue 10); each wired where its behaviour lives.
    kv_unified: bool = False  # one slot may grow into the whole shared KV pool
    cache_type_k: str = "f16"  # -ctk: KV cache type (f16, q8_0, ...)
    cache_type_v: str = "f16"  # -ctv
    no_mmap: bool = False
    mlock: bool = False
    no_warmup: bool = False
    context_shift: bool = False
    no_slots: bool = False  # slot endpoints answer 501
    metrics: bool = False  # /metrics answers only with --metrics (llama-server's default: off)
    verbose: bool = False
    # CORS (engine_pool/cors.py), llama-server's flags and defaults. No --cors-origins: `*`, or
    # `localhost` with --ui-mcp-proxy (a page on any site must not drive an open proxy on this machine).
    cors_origins: str | None = None
    cors_methods: str = "GET, POST, DELETE, OPTIONS"
    cors_headers: str = "*"
    cors_credentials: bool = True
    ui_mcp_proxy: bool = False  # /cors-proxy forwards requests for the web UI's MCP client
    tags: str = ""  # comma-separated model tags reported by /v1/models and /props
    offline: bool = False  # accepted: this engine never downloads anything
    # Vertex AI's custom-container contract (llama-server's GCP compatibility), from AIP_* variables:
    # the prediction route (apis/vertex.py), served only with AIP_MODE=PREDICTION.
    predict_route: str | None = None

    @property
    def aliases(self) -> tuple[str, ...]:
        """Every name `--alias` gives the model (comma-separated, as llama-server), in order, once each."""
        return _csv(self.alias or "")

    @property
    def model_id(self) -> str:
        """The name the model is reported by: the alphabetically first `--alias` (llama-server keeps
        them in a sorted set), else the file name."""
        aliases = self.aliases
        if aliases:
            return min(aliases)
        return self.model.rsplit("/", 1)[-1]

    @property
    def model_tags(self) -> tuple[str, ...]:
        """`--tags`: informational labels reported by /v1/models, never used to route."""
        return _csv(self.tags)

    @property
    def hosts(self) -> tuple[str, ...]:
        """`--host`: the addresses to listen on; one ending in `.sock` is a UNIX socket path."""
        return _csv(self.host)

    @property
    def tcp_hosts(self) -> tuple[str, ...]:
        return tuple(h for h in self.hosts if not h.endswith(".sock"))

    @property
    def cors_origin_list(self) -> tuple[str, ...]:
        """`--cors-origins`: `*` (any), `localhost` (only local pages), or the origins allowed."""
        if self.cors_origins is None:
            return ("localhost",) if self.ui_mcp_proxy else ("*",)
        return _csv(self.cors_origins)

    @property
    def effective_log_level(self) -> str:
        """`-v/--verbose` logs everything (llama-server's "verbosity to infinity")."""
        return "debug" if self.verbose else self.log_level


def _csv(text: str) -> tuple[str, ...]:
    """A comma-separated list: items stripped, empty ones dropped, duplicates kept once (first place)."""
    return tuple(dict.fromkeys(p for p in (s.strip() for s in text.split(",")) if p))


# llama-server's `-ctk/-ctv` values (common/arg.cpp's kv_cache_types).
CACHE_TYPES = native.KV_CACHE_TYPES  # llama-server's names, as the core accepts them


def _cache_type(text: str) -> str:
    if text not in CACHE_TYPES:
        raise ValueError(f"allowed values: {', '.join(CACHE_TYPES)}")
    return text


def _threads(text: str) -> int:
    n = int(text)
    return 0 if n < 0 else n  # llama-server's -1 (auto) is the core's 0


FLAGS: tuple[Flag, ...] = (
    Flag("model", ("-m", "--model"), "SLOTKEEPER_MODEL", str, "GGUF model file", required=True),
    Flag(
        "host",
        ("--host",),
        "SLOTKEEPER_HOST",
        str,
        "addresses to listen on, comma-separated; one ending in .sock is a UNIX socket path; with several "
        "TCP addresses :: binds IPv6 only (127.0.0.1)",
    ),
    Flag("port", ("--port",), "SLOTKEEPER_PORT", parse_int, "port to listen on (8080)"),
    Flag("n_slots", ("-np", "--parallel"), "SLOTKEEPER_PARALLEL", parse_int, "number of slots (1)"),
    Flag(
        "n_ctx",
        ("-c", "--ctx-size"),
        "SLOTKEEPER_CTX_SIZE",
        parse_int,
        "total context (KV cells) shared by the slots; each slot gets ctx-size / parallel (4096)",
    ),
    Flag("n_batch", ("-b", "--batch-size"), "SLOTKEEPER_BATCH_SIZE", parse_int, "logical batch size (2048)"),
    Flag(
        "n_ubatch", ("-ub", "--ubatch-size"), "SLOTKEEPER_UBATCH_SIZE", parse_int, "physical batch size (512)"
    ),
    Flag("n_threads", ("-t", "--threads"), "SLOTKEEPER_THREADS", _threads, "CPU threads (-1/0: all)"),
    Flag(
        "n_gpu_layers",
        ("-ngl", "--n-gpu-layers", "--gpu-layers"),
        "SLOTKEEPER_N_GPU_LAYERS",
        parse_int,
        "layers to offload to the GPU (0)",
    ),
    Flag("seed", ("-s", "--seed"), "SLOTKEEPER_SEED", parse_int, "default sampling seed (-1: random)"),
    Flag("temperature", ("--temp",), "SLOTKEEPER_TEMP", float, "default temperature (0.8)"),
    Flag(
        "n_predict",
        ("-n", "--n-predict"),
        "SLOTKEEPER_N_PREDICT",
        parse_int,
        "default tokens to predict (-1: until a stop or the slot's context is full)",
    ),
    Flag(
        "alias",
        ("-a", "--alias"),
        "SLOTKEEPER_ALIAS",
        str,
        "model names, comma-separated, listed by /v1/models; the first is the model id (file name)",
    ),
    Flag(
        "tags",
        ("--tags",),
        "SLOTKEEPER_TAGS",
        str,
        "model tags, comma-separated, listed by /v1/models (informational, never used to route)",
    ),
    Flag(
        "slot_save_path",
        ("--slot-save-path",),
        "SLOTKEEPER_SLOT_SAVE_PATH",
        str,
        "directory of slot files for /slots/{id}?action=save|restore (disabled without it)",
    ),
    Flag(
        "max_checkpoints",
        ("--ctx-checkpoints", "--swa-checkpoints"),
        "SLOTKEEPER_CTX_CHECKPOINTS",
        parse_int,
        "checkpoints kept per slot (32; 0 disables them)",
    ),
    Flag(
        "checkpoint_min_step",
        ("--checkpoint-min-step",),
        "SLOTKEEPER_CHECKPOINT_MIN_STEP",
        parse_int,
        "minimum distance in tokens between checkpoints (64)",
    ),
    Flag(
        "checkpoint_interval",
        ("--checkpoint-interval",),
        "SLOTKEEPER_CHECKPOINT_INTERVAL",
        parse_int,
        "checkpoint every this many tokens inside long prompts (2048; 0: off)",
    ),
    Flag(
        "max_checkpoint_bytes",
        ("--max-checkpoint-bytes",),
        "SLOTKEEPER_MAX_CHECKPOINT_BYTES",
        parse_bytes,
        "checkpoint memory per slot, e.g. 512M (1G)",
    ),
    Flag(
        "max_slot_file_bytes",
        ("--max-slot-file-bytes",),
        "SLOTKEEPER_MAX_SLOT_FILE_BYTES",
        parse_bytes,
        "refuse to restore larger slot files (0: no limit)",
    ),
    Flag("swa_full", ("--swa-full",), "SLOTKEEPER_SWA_FULL", parse_bool, "full-size SWA cache", switch=True),
    Flag(
        "flash_attn",
        ("-fa", "--flash-attn"),
        "SLOTKEEPER_FLASH_ATTN",
        parse_bool,
        "flash attention: on|off|auto",
    ),
    Flag("api_key", ("--api-key",), "SLOTKEEPER_API_KEY", str, "require this key (Authorization: Bearer)"),
    Flag(
        "queue_size",
        ("--queue-size",),
        "SLOTKEEPER_QUEUE_SIZE",
        parse_int,
        "requests that may wait for a busy slot; more get 503 + Retry-After (16)",
    ),
    Flag(
        "slot_wait_s",
        ("--slot-wait-timeout",),
        "SLOTKEEPER_SLOT_WAIT_TIMEOUT",
        float,
        "seconds a slot save/restore/erase waits for a busy slot (30)",
    ),
    Flag(
        "retry_after_s",
        ("--retry-after",),
        "SLOTKEEPER_RETRY_AFTER",
        parse_int,
        "Retry-After seconds on 503 responses (1)",
    ),
    Flag(
        "shutdown_grace_s",
        ("--shutdown-grace",),
        "SLOTKEEPER_SHUTDOWN_GRACE",
        float,
        "seconds in-flight requests may finish after SIGTERM before they are aborted (10)",
    ),
    Flag(
        "exit_with_parent",
        ("--exit-with-parent",),
        "SLOTKEEPER_EXIT_WITH_PARENT",
        parse_bool,
        "stop (as on SIGTERM) when the process that started this one dies (Linux; set by the node agent)",
        switch=True,
    ),
    Flag(
        "instance_id",
        ("--instance-id",),
        "SLOTKEEPER_INSTANCE_ID",
        str,
        "this process's name, new at every start (set by the node agent): a request naming another "
        "one in X-Slotkeeper-Instance is refused with 409 before it reaches a slot",
    ),
    LOG_FORMAT,
    Flag("log_level", ("--log-level",), "SLOTKEEPER_LOG_LEVEL", str, "debug, info, warning, error (info)"),
    Flag(
        "verbose",
        ("-v", "--log-verbose", "--verbose"),
        "SLOTKEEPER_VERBOSE",
        parse_bool,
        "log everything: --log-level debug, plus every request and response body (first 64 KiB)",
        switch=True,
    ),
    # -- llama-server's endpoints and its CORS ---------------------------------------------------------
    Flag(
        "metrics",
        ("--metrics",),
        "SLOTKEEPER_METRICS",
        parse_bool,
        "serve Prometheus metrics on /metrics (without it: 501, as llama-server)",
        switch=True,
    ),
    Flag(
        "no_slots",
        ("--no-slots",),
        "SLOTKEEPER_NO_SLOTS",
        parse_bool,
        "answer GET /slots and POST /slots/{id} with 501 (--slots: serve them, the default)",
        switch=True,
    ),
    Flag(
        "cors_origins",
        ("--cors-origins",),
        "SLOTKEEPER_CORS_ORIGINS",
        str,
        "origins whose pages may call this API, comma-separated; * any (with credentials, the Origin is "
        "echoed), localhost only pages served from this machine (*; localhost with --ui-mcp-proxy)",
    ),
    Flag(
        "cors_methods",
        ("--cors-methods",),
        "SLOTKEEPER_CORS_METHODS",
        str,
        "Access-Control-Allow-Methods of a preflight's answer (GET, POST, DELETE, OPTIONS)",
    ),
    Flag(
        "cors_headers",
        ("--cors-headers",),
        "SLOTKEEPER_CORS_HEADERS",
        str,
        "Access-Control-Allow-Headers of a preflight's answer (*; in a browser * never covers Authorization)",
    ),
    Flag(
        "cors_credentials",
        ("--cors-credentials",),
        "SLOTKEEPER_CORS_CREDENTIALS",
        parse_bool,
        "allow credentialed requests; with --cors-origins * the Origin is echoed (on; --no-cors-credentials)",
        switch=True,
    ),
    Flag(
        "ui_mcp_proxy",
        ("--ui-mcp-proxy", "--webui-mcp-proxy"),
        "SLOTKEEPER_UI_MCP_PROXY",
        parse_bool,
        "serve /cors-proxy?url=URL: forwards GET/POST to URL with only the x-llama-server-proxy-header-* "
        "headers; do not enable in untrusted environments (off: 403)",
        switch=True,
    ),
    Flag(
        "offline",
        ("--offline",),
        "SLOTKEEPER_OFFLINE",
        parse_bool,
        "accepted for llama-server command lines: this engine never downloads anything",
        switch=True,
    ),
    # -- the model and its KV cache (llama-server's flags; wired in runtime.py) -------------------------
    Flag(
        "kv_unified",
        ("-kvu", "--kv-unified"),
        "SLOTKEEPER_KV_UNIFIED",
        parse_bool,
        "one KV buffer shared by all slots (-no-kvu/--no-kv-unified: off, the default)",
        switch=True,
    ),
    Flag(
        "cache_type_k",
        ("-ctk", "--cache-type-k"),
        "SLOTKEEPER_CACHE_TYPE_K",
        _cache_type,
        f"KV cache type of K: {', '.join(CACHE_TYPES)} (f16)",
    ),
    Flag(
        "cache_type_v",
        ("-ctv", "--cache-type-v"),
        "SLOTKEEPER_CACHE_TYPE_V",
        _cache_type,
        f"KV cache type of V: {', '.join(CACHE_TYPES)} (f16)",
    ),
    Flag(
        "no_mmap",
        ("--no-mmap",),
        "SLOTKEEPER_NO_MMAP",
        parse_bool,
        "read the model into memory instead of mapping it (--mmap: map it, the default)",
        switch=True,
    ),
    Flag(
        "mlock", ("--mlock",), "SLOTKEEPER_MLOCK", parse_bool, "keep the model in RAM (no swap)", switch=True
    ),
    Flag(
        "no_warmup",
        ("--no-warmup",),
        "SLOTKEEPER_NO_WARMUP",
        parse_bool,
        "skip the empty warm-up run at load (--warmup: run it, the default)",
        switch=True,
    ),
    Flag(
        "context_shift",
        ("--context-shift",),
        "SLOTKEEPER_CONTEXT_SHIFT",
        parse_bool,
        "shift the context when a generation fills it (--no-context-shift: stop instead, the default)",
        switch=True,
    ),
    # -- request limits (the gateway uses the same names for its own edge limits) --------------------
    Flag(
        "max_body_bytes",
        ("--max-body-bytes",),
        "SLOTKEEPER_MAX_BODY_BYTES",
        parse_bytes,
        "largest request body, e.g. 16M; larger ones get 413 (16M)",
    ),
    Flag(
        "max_json_depth",
        ("--max-json-depth",),
        "SLOTKEEPER_MAX_JSON_DEPTH",
        parse_int,
        "deepest JSON nesting of a request body (64)",
    ),
    Flag(
        "body_timeout_s",
        ("--body-timeout-s",),
        "SLOTKEEPER_BODY_TIMEOUT_S",
        float,
        "seconds a client may take to send its request body; slower ones get 408 (60)",
    ),
    Flag(
        "max_messages",
        ("--max-messages",),
        "SLOTKEEPER_MAX_MESSAGES",
        parse_int,
        "messages per request (4096)",
    ),
    Flag("max_tools", ("--max-tools",), "SLOTKEEPER_MAX_TOOLS", parse_int, "tools per request (512)"),
    Flag(
        "max_text_chars",
        ("--max-text-chars",),
        "SLOTKEEPER_MAX_TEXT_CHARS",
        parse_bytes,
        "characters of text in one request's messages or prompts, e.g. 4M (1M)",
    ),
    Flag("max_stop", ("--max-stop",), "SLOTKEEPER_MAX_STOP", parse_int, "stop strings per request (16)"),
    Flag(
        "max_stop_chars",
        ("--max-stop-chars",),
        "SLOTKEEPER_MAX_STOP_CHARS",
        parse_int,
        "characters per stop string (256)",
    ),
    Flag(
        "max_logit_bias",
        ("--max-logit-bias",),
        "SLOTKEEPER_MAX_LOGIT_BIAS",
        parse_int,
        "logit_bias entries (2048)",
    ),
    Flag(
        "max_grammar_bytes",
        ("--max-grammar-bytes",),
        "SLOTKEEPER_MAX_GRAMMAR_BYTES",
        parse_bytes,
        "size of a request's raw GBNF `grammar` (64K)",
    ),
    Flag(
        "max_grammar_depth",
        ("--max-grammar-depth",),
        "SLOTKEEPER_MAX_GRAMMAR_DEPTH",
        parse_int,
        "parenthesis nesting of a raw GBNF `grammar` (64; llama.cpp parses it recursively)",
    ),
    Flag(
        "max_schema_depth",
        ("--max-schema-depth",),
        "SLOTKEEPER_MAX_SCHEMA_DEPTH",
        parse_int,
        "nesting of a JSON schema (response_format, json_schema, tool parameters), $refs included (32)",
    ),
    Flag(
        "max_schema_grammar_bytes",
        ("--max-schema-grammar-bytes",),
        "SLOTKEEPER_MAX_SCHEMA_GRAMMAR_BYTES",
        parse_bytes,
        "size of the grammar built from a request's JSON schemas and tools (2M)",
    ),
    Flag(
        "max_schema_grammar_rules",
        ("--max-schema-grammar-rules",),
        "SLOTKEEPER_MAX_SCHEMA_GRAMMAR_RULES",
        parse_int,
        "rules in the grammar built from a request's JSON schemas and tools (32768)",
    ),
    Flag(
        "chat_template",
        ("--chat-template",),
        "SLOTKEEPER_CHAT_TEMPLATE",
        str,
        "chat template: a built-in name (chatml, ...) or a jinja template; overrides the GGUF's",
    ),
    Flag(
        "chat_template_file",
        ("--chat-template-file",),
        "SLOTKEEPER_CHAT_TEMPLATE_FILE",
        str,
        "read the chat template (jinja) from this file; overrides the GGUF's",
    ),
    Flag(
        "no_repack",
        ("-nr", "--no-repack"),
        "SLOTKEEPER_NO_REPACK",
        parse_bool,
        "no weight repacking (llama.cpp extra buffer types); always off on CPUs with AMX",
        switch=True,
    ),
    Flag(
        "jinja", ("--jinja",), "SLOTKEEPER_JINJA", parse_bool, "jinja chat templates (always on)", switch=True
    ),
    Flag(
        "reasoning",
        ("-rea", "--reasoning"),
        "SLOTKEEPER_REASONING",
        str,
        "whether the model reasons: on, off (enable_thinking false for the template, and a reasoning "
        "block the prompt still opens is closed), auto: the template's default (auto)",
    ),
    Flag(
        "reasoning_format",
        ("--reasoning-format",),
        "SLOTKEEPER_REASONING_FORMAT",
        str,
        "where reasoning goes: none (left in content), deepseek / auto (reasoning_content), "
        "deepseek-legacy (both) (auto)",
    ),
    Flag(
        "chat_format",
        ("--chat-format",),
        "SLOTKEEPER_CHAT_FORMAT",
        str,
        "tool-call format: auto (detected from the template: a family's own, else llama.cpp's chat "
        "layer), hermes, qwen-xml, lfm2, nemotron-h, llama.cpp (auto)",
    ),
)

# Checked after parsing: (field, predicate, what it must be).
_CHECKS: tuple[Check, ...] = (
    ("host", lambda v: bool(_csv(v)), "one or more addresses"),
    ("port", lambda v: 0 <= v <= 65535, "within 0..65535"),
    ("n_slots", lambda v: 1 <= v <= 256, "within 1..256"),
    ("n_ctx", lambda v: v >= 16, "at least 16"),
    ("n_batch", lambda v: v >= 1, "positive"),
    ("n_ubatch", lambda v: v >= 1, "positive"),
    ("n_predict", lambda v: v >= -1, ">= -1"),
    ("max_checkpoints", lambda v: v >= 0, ">= 0"),
    ("checkpoint_min_step", lambda v: v >= 0, ">= 0"),
    ("checkpoint_interval", lambda v: v >= 0, ">= 0"),
    ("max_checkpoint_bytes", lambda v: v >= 0, ">= 0"),
    ("max_slot_file_bytes", lambda v: v >= 0, ">= 0"),
    ("queue_size", lambda v: v >= 0, ">= 0"),
    ("slot_wait_s", lambda v: v >= 0, ">= 0"),
    ("shutdown_grace_s", lambda v: v >= 0, ">= 0"),
    ("temperature", lambda v: v >= 0, ">= 0"),
    ("log_level", lambda v: v in ("debug", "info", "warning", "error"), "debug, info, warning or error"),
    ("cors_origins", lambda v: v is None or bool(_csv(v)), "*, localhost or one or more origins"),
    ("cors_methods", lambda v: bool(_csv(v)), "one or more methods"),
    ("max_body_bytes", lambda v: v >= 1024, ">= 1024"),
    ("max_json_depth", lambda v: 4 <= v <= 512, "within 4..512"),
    ("body_timeout_s", lambda v: v > 0, "> 0"),
    ("max_messages", lambda v: v >= 1, ">= 1"),
    ("max_tools", lambda v: v >= 0, ">= 0"),
    ("max_text_chars", lambda v: v >= 1, ">= 1"),
    ("max_stop", lambda v: v >= 0, ">= 0"),
    ("max_stop_chars", lambda v: v >= 1, ">= 1"),
    ("max_logit_bias", lambda v: v >= 0, ">= 0"),
    ("max_grammar_bytes", lambda v: v >= 0, ">= 0"),
    # llama.cpp parses GBNF recursively (one C++ frame chain per parenthesis) on the event loop's
    # thread: a few thousand levels crash the process, so this bound is not the operator's to lift.
    ("max_grammar_depth", lambda v: 1 <= v <= 1024, "within 1..1024"),
    # The schema walk recurses in Python (a few frames per level, under the interpreter's 1000).
    ("max_schema_depth", lambda v: 1 <= v <= 128, "within 1..128"),
    ("max_schema_grammar_bytes", lambda v: v >= 1024, ">= 1024"),
    ("max_schema_grammar_rules", lambda v: v >= 16, ">= 16"),
    ("chat_format", lambda v: v in CHAT_FORMATS, f"one of {', '.join(CHAT_FORMATS)}"),
    ("reasoning", lambda v: v in ("on", "off", "auto"), "on, off or auto"),
    (
        "reasoning_format",
        lambda v: v in REASONING_FORMATS,
        f"one of {', '.join(REASONING_FORMATS)}",
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

_PROG = "slotkeeper engine"
_DESCRIPTION = (
    "One engine process: a llama-server-compatible API and OpenAI chat over the native core. "
    "Every flag can also be set by its SLOTKEEPER_* variable."
)


def build_parser() -> argparse.ArgumentParser:
    parser = _build_parser(_PROG, _DESCRIPTION, FLAGS, defaults_of(EngineSettings))
    by_field = {f.field: f for f in FLAGS}
    for name, flags in SWITCHES_OFF:
        on = by_field[name]
        parser.add_argument(*flags, dest=name, action="store_const", const="off", help=f"undoes {on.name}")
    return parser


def vertex_values(environ: Mapping[str, str]) -> dict[str, Any]:
    """What a Vertex AI container's variables set, as llama-server reads them: with
    `AIP_MODE=PREDICTION`, `AIP_PREDICT_ROUTE` (default `/predict`) is served and `AIP_HTTP_PORT`
    is the port (over `--port`: Vertex sends traffic there). Nothing without that mode."""
    if environ.get("AIP_MODE") != "PREDICTION":
        return {}
    route = environ.get("AIP_PREDICT_ROUTE") or "/predict"
    if not route.startswith("/"):
        raise SettingsError(f"AIP_PREDICT_ROUTE: invalid value {route!r} (a path starting with /)")
    values: dict[str, Any] = {"predict_route": route}
    if environ.get("AIP_HTTP_PORT"):
        try:
            values["port"] = parse_int(environ["AIP_HTTP_PORT"])
        except ValueError as exc:
            raise SettingsError(
                f"AIP_HTTP_PORT: invalid value {environ['AIP_HTTP_PORT']!r} ({exc})"
            ) from None
    return values


def parse_settings(argv: Sequence[str], environ: Mapping[str, str]) -> EngineSettings:
    """Settings from a command line and an environment. Raises SettingsError with a precise message."""
    args = vars(build_parser().parse_args(list(argv)))
    settings = EngineSettings(**{**values_from(args, FLAGS, environ), **vertex_values(environ)})
    check(settings, FLAGS, _CHECKS)
    if settings.port == 0 and len(settings.tcp_hosts) > 1:
        # Each TCP address would get a port of its own; llama-server refuses this too.
        raise SettingsError("--port 0 is not supported with multiple TCP addresses")
    return settings


def describe(settings: EngineSettings) -> dict[str, Any]:
    """The settings as loggable data (the API key is never logged)."""
    out = dataclasses.asdict(settings)
    if out.get("api_key"):
        out["api_key"] = "***"
    return out

"""Settings of one engine process: llama-server's flags, their SLOTKEEPER_* variables, one frozen object.

`FLAGS` is the single table that maps every command-line flag to its settings field, its environment
variable, its default and its check (command line > environment > default); the variable is
SLOTKEEPER_ + the long flag's name, as llama-server's LLAMA_ARG_* (`--parallel` →
SLOTKEEPER_PARALLEL). Limits the gateway shares are rows of `engine_pool.process.limit_flags`. `SWITCHES_OFF`
adds the other half of llama-server's `--x/--no-x` pairs. `parse_settings(argv, environ)` is the
only reader of the tables; `engine_main` hands it `os.environ`, nothing else reads the environment.
Flags keep llama-server's names and meanings, so a command line written for llama-server starts this
engine unchanged as long as it uses the common flags; anything unknown is refused with a clear
message rather than silently ignored. Lists (`--alias`, `--tags`, `--host`, `--cors-origins`) are
comma-separated, as there.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import native
from engine_pool.process.flags import (
    LOG_FORMAT,
    LOG_LEVEL,
    NO_DEFAULT,
    Flag,
    SettingsError,
    at_least,
    bool_flag,
    bytes_flag,
    check_settings,
    flag,
    float_flag,
    int_flag,
    one_of,
    parse_int,
    str_flag,
    switch,
    table_defaults,
    values_from,
    within,
)
from engine_pool.process.flags import build_parser as _build_parser
from engine_pool.process.limit_flags import BODY_TIMEOUT_S, MAX_BODY_BYTES, MAX_JSON_DEPTH, MAX_MESSAGES

from ..protocol.handoff import ROLES
from .formats import CHAT_FORMATS
from .formats.output import REASONING_FORMATS
from .grammar import GrammarLimits

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


def _csv(text: str) -> tuple[str, ...]:
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
        (lambda v: bool(_csv(v)), "one or more addresses"),
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
        (lambda v: v is None or bool(_csv(v)), "*, localhost or one or more origins"),
    ),
    str_flag(
        "cors_methods",
        "--cors-methods",
        "GET, POST, DELETE, OPTIONS",
        "Access-Control-Allow-Methods of a preflight's answer (GET, POST, DELETE, OPTIONS)",
        (lambda v: bool(_csv(v)), "one or more methods"),
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

_DEFAULT = table_defaults(FLAGS)


@dataclass(frozen=True)
class EngineSettings:
    """Everything one engine process is configured with. Built once, at the edge."""

    model: str
    host: str = _DEFAULT["host"]
    port: int = _DEFAULT["port"]
    n_slots: int = _DEFAULT["n_slots"]
    n_ctx: int = _DEFAULT["n_ctx"]
    n_batch: int = _DEFAULT["n_batch"]
    n_ubatch: int = _DEFAULT["n_ubatch"]
    n_threads: int = _DEFAULT["n_threads"]
    n_gpu_layers: int = _DEFAULT["n_gpu_layers"]
    seed: int = _DEFAULT["seed"]
    temperature: float = _DEFAULT["temperature"]
    n_predict: int = _DEFAULT["n_predict"]
    alias: str | None = _DEFAULT["alias"]
    slot_save_path: str | None = _DEFAULT["slot_save_path"]
    max_checkpoints: int = _DEFAULT["max_checkpoints"]
    checkpoint_min_step: int = _DEFAULT["checkpoint_min_step"]
    checkpoint_interval: int = _DEFAULT["checkpoint_interval"]
    max_checkpoint_bytes: int = _DEFAULT["max_checkpoint_bytes"]
    max_stored_checkpoints: int = _DEFAULT["max_stored_checkpoints"]
    max_stored_checkpoint_bytes: int = _DEFAULT["max_stored_checkpoint_bytes"]
    max_slot_file_bytes: int = _DEFAULT["max_slot_file_bytes"]
    swa_full: bool = _DEFAULT["swa_full"]
    flash_attn: bool = _DEFAULT["flash_attn"]
    api_key: str | None = _DEFAULT["api_key"]
    queue_size: int = _DEFAULT["queue_size"]
    slot_wait_s: float = _DEFAULT["slot_wait_s"]
    retry_after_s: int = _DEFAULT["retry_after_s"]
    shutdown_grace_s: float = _DEFAULT["shutdown_grace_s"]
    exit_with_parent: bool = _DEFAULT["exit_with_parent"]
    instance_id: str | None = _DEFAULT["instance_id"]
    log_format: str = _DEFAULT["log_format"]  # console on a terminal, JSON lines otherwise
    log_level: str = _DEFAULT["log_level"]
    # What one request may ask (each refused with a precise 4xx naming the field and the limit; see
    # limits.py and DESIGN.md "Limits").
    max_body_bytes: int = _DEFAULT["max_body_bytes"]
    max_json_depth: int = _DEFAULT["max_json_depth"]
    body_timeout_s: float = _DEFAULT["body_timeout_s"]
    max_messages: int = _DEFAULT["max_messages"]
    max_tools: int = _DEFAULT["max_tools"]
    max_text_chars: int = _DEFAULT["max_text_chars"]
    max_stop: int = _DEFAULT["max_stop"]
    max_stop_chars: int = _DEFAULT["max_stop_chars"]
    max_logit_bias: int = _DEFAULT["max_logit_bias"]
    max_grammar_bytes: int = _DEFAULT["max_grammar_bytes"]
    max_grammar_depth: int = _DEFAULT["max_grammar_depth"]
    max_schema_depth: int = _DEFAULT["max_schema_depth"]
    max_schema_grammar_bytes: int = _DEFAULT["max_schema_grammar_bytes"]
    max_schema_grammar_rules: int = _DEFAULT["max_schema_grammar_rules"]
    # Chat templates and formats (llama-server's flags; see chat_template.py and formats/).
    chat_template: str | None = _DEFAULT[
        "chat_template"
    ]  # a built-in template name or an inline jinja template
    chat_template_file: str | None = _DEFAULT["chat_template_file"]
    jinja: bool = _DEFAULT[
        "jinja"
    ]  # accepted for llama-server command lines: templates are always jinja here
    reasoning_format: str = _DEFAULT["reasoning_format"]  # none | deepseek | deepseek-legacy | auto
    reasoning: str = _DEFAULT[
        "reasoning"
    ]  # on | off | auto: whether the model reasons (llama-server's --reasoning)
    chat_format: str = _DEFAULT[
        "chat_format"
    ]  # the tool-call format: auto (from the template), a family's or llama.cpp's
    role: str = _DEFAULT["role"]  # prefill | decode | mixed (engine_pool.protocol.handoff)
    no_repack: bool = _DEFAULT[
        "no_repack"
    ]  # llama-server's --no-repack (also forced for quantized models on CPUs with AMX: runtime.py)
    # llama-server drop-in flags (issue 10); each wired where its behaviour lives.
    kv_unified: bool = _DEFAULT["kv_unified"]  # one slot may grow into the whole shared KV pool
    cache_type_k: str = _DEFAULT["cache_type_k"]  # -ctk: KV cache type (f16, q8_0, ...)
    cache_type_v: str = _DEFAULT["cache_type_v"]  # -ctv
    no_mmap: bool = _DEFAULT["no_mmap"]
    mlock: bool = _DEFAULT["mlock"]
    no_warmup: bool = _DEFAULT["no_warmup"]
    context_shift: bool = _DEFAULT["context_shift"]
    no_slots: bool = _DEFAULT["no_slots"]  # slot endpoints answer 501
    metrics: bool = _DEFAULT["metrics"]  # /metrics answers only with --metrics (llama-server's default: off)
    verbose: bool = _DEFAULT["verbose"]
    # CORS (engine_pool/http/cors.py), llama-server's flags and defaults. No --cors-origins: `*`, or
    # `localhost` with --ui-mcp-proxy (a page on any site must not drive an open proxy on this machine).
    cors_origins: str | None = _DEFAULT["cors_origins"]
    cors_methods: str = _DEFAULT["cors_methods"]
    cors_headers: str = _DEFAULT["cors_headers"]
    cors_credentials: bool = _DEFAULT["cors_credentials"]
    ui_mcp_proxy: bool = _DEFAULT["ui_mcp_proxy"]  # /cors-proxy forwards requests for the web UI's MCP client
    tags: str = _DEFAULT["tags"]  # comma-separated model tags reported by /v1/models and /props
    offline: bool = _DEFAULT["offline"]  # accepted: this engine never downloads anything
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
    parser = _build_parser(_PROG, _DESCRIPTION, FLAGS)
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
    check_settings(settings, FLAGS)
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

"""Settings of one engine process: one frozen object, built at the edge from the command line and
the SLOTKEEPER_* variables of `engine_pool.server.engine_flags` (its table, `FLAGS`).
`parse_settings(argv, environ)` is the only reader of the table; `engine_main` hands it `os.environ`,
nothing else reads the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine_pool.process.flags import (
    SettingsError,
    check_settings,
    parse_int,
    table_defaults,
    values_from,
)
from engine_pool.process.flags import build_parser as _build_parser

from .engine_flags import CACHE_TYPES, FLAGS, SWITCHES_OFF, csv_list

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
        return csv_list(self.alias or "")

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
        return csv_list(self.tags)

    @property
    def hosts(self) -> tuple[str, ...]:
        """`--host`: the addresses to listen on; one ending in `.sock` is a UNIX socket path."""
        return csv_list(self.host)

    @property
    def tcp_hosts(self) -> tuple[str, ...]:
        return tuple(h for h in self.hosts if not h.endswith(".sock"))

    @property
    def cors_origin_list(self) -> tuple[str, ...]:
        """`--cors-origins`: `*` (any), `localhost` (only local pages), or the origins allowed."""
        if self.cors_origins is None:
            return ("localhost",) if self.ui_mcp_proxy else ("*",)
        return csv_list(self.cors_origins)

    @property
    def effective_log_level(self) -> str:
        """`-v/--verbose` logs everything (llama-server's "verbosity to infinity")."""
        return "debug" if self.verbose else self.log_level


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

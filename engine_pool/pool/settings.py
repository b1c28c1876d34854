"""Settings of one node agent (`slotkeeper node`): flags, their SLOTKEEPER_* variables, one frozen object.

`FLAGS` is the single table mapping each flag to its field, variable, default and check (command
line > environment > default); a variable is SLOTKEEPER_ + the long flag's name (`--slots` →
SLOTKEEPER_SLOTS); `parse_node_settings(argv, environ)` is its only reader and `node_main` hands it
`os.environ`. Repeatable flags (`--model`, `--alias`, `--engine-arg`) take their variable, named
after the field (SLOTKEEPER_MODELS), as a comma-separated list. S3 credentials have variables only (a
secret on a command line shows in `ps`); without them boto3's usual chain (AWS_* variables, ~/.aws,
instance roles) applies.

`--ctx` is the context of ONE slot, in tokens: an engine with `--slots N` gets `-c N×ctx`, so a
session holds the same number of tokens whatever the slot count.
"""

from __future__ import annotations

import argparse
import dataclasses
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_pool.http.credentials import engine_environment
from engine_pool.process.flags import (
    LOG_FORMAT,
    LOG_LEVEL,
    NO_DEFAULT,
    S3_ENDPOINT,
    Flag,
    SettingsError,
    above,
    at_least,
    bytes_flag,
    check_settings,
    env_name,
    flag,
    float_flag,
    int_flag,
    list_flag,
    one_of,
    read_flags,
    str_flag,
    table_defaults,
    within,
)
from engine_pool.process.flags import build_parser as _build_parser
from storage.errors import InvalidId
from storage.ids import validate_id, validate_prefix
from storage.index.topology import redis_url_check

from ..protocol.handoff import ROLES, Role
from .supervisor import EngineSpec, SupervisorPolicy

REDIS_URL = redis_url_check()


def _ids(values: tuple[str, ...]) -> bool:
    try:
        for v in values:
            validate_id(v, "id")
    except InvalidId:
        return False
    return True


def _prefix(value: str) -> bool:
    try:
        validate_prefix(value)
    except InvalidId:
        return False
    return True


_ON_OFF_AUTO = one_of("on", "off", "auto")

FLAGS: tuple[Flag, ...] = (
    list_flag(
        "models",
        "-m --model",
        "GGUF model; one engine each",
        (lambda v: len(v) >= 1, "given at least once"),
        default=NO_DEFAULT,
    ),
    list_flag(
        "aliases", "--alias", "model id of the Nth --model", (_ids, "valid ids (letters, digits, '-_.~@+=')")
    ),
    list_flag(
        "roles",
        "--role",
        "role of the Nth --model's engine: prefill, decode or mixed (default: mixed)",
        (lambda v: all(r in ROLES for r in v), f"each one of {', '.join(ROLES)}"),
    ),
    str_flag(
        "node_id",
        "--node-id",
        "",
        "id of this node (host name)",
        (lambda v: _ids((v,)), "a valid id (letters, digits, '-_.~@+=')"),
    ),
    str_flag("host", "--host", "127.0.0.1", "address of the node API (127.0.0.1)"),
    int_flag("port", "--port", 8070, "port of the node API (8070)", within(0, 65535)),
    int_flag("n_slots", "--slots", 1, "slots per engine (1)", within(1, 256)),
    int_flag(
        "ctx_per_slot",
        "--ctx",
        4096,
        "context of one slot in tokens (4096)",
        (lambda v: v >= 16, "at least 16"),
    ),
    str_flag("data_dir", "--data-dir", "slotkeeper-data", "engine slot dirs, spill cache, logs"),
    str_flag(
        "redis_url",
        "--redis-url",
        None,
        "Redis URL: redis://, rediss://, redis-cluster://, redis-sentinel:// (omitted: in-process index)",
        REDIS_URL,
    ),
    str_flag("redis_prefix", "--redis-prefix", "slotkeeper", "Redis key prefix"),
    str_flag("s3_endpoint", "--s3-endpoint", None, "S3 endpoint URL", S3_ENDPOINT),
    str_flag("s3_bucket", "--s3-bucket", None, "S3 bucket (omitted: local store)"),
    str_flag(
        "s3_prefix",
        "--s3-prefix",
        "slotkeeper",
        "blob key prefix (slotkeeper)",
        (_prefix, "'/'-separated valid ids"),
    ),
    str_flag("s3_region", "--s3-region", "us-east-1", "S3 region (us-east-1)"),
    str_flag("s3_access_key", "", None, "S3 access key"),
    str_flag("s3_secret_key", "", None, "S3 secret key"),
    str_flag("internal_key", "", None, "the credential the gateway presents (required)"),
    bytes_flag("spill_bytes", "--spill-bytes", 8 << 30, "spill cache budget (8G)", at_least(0)),
    bytes_flag(
        "spill_pending_bytes",
        "--spill-pending-bytes",
        32 << 30,
        "saves kept on disk while the store is down; past it a save answers 503 (32G)",
        at_least(0),
    ),
    bytes_flag(
        "restore_bytes_in_flight",
        "--restore-bytes-in-flight",
        4 << 30,
        "bytes of slot files restores (and handoff installs) may hold at once; the others wait "
        "their turn, and one larger than this runs alone (4G; 0: no bound)",
        at_least(0),
    ),
    str_flag(
        "store_compression",
        "--store-compression",
        "off",
        "store recurrent states compressed: on, off (default), auto (on in S3, off on a local disk)",
        _ON_OFF_AUTO,
    ),
    list_flag(
        "engine_args",
        "--engine-arg",
        "one more argument for every engine, e.g. --engine-arg=--ctx-checkpoints --engine-arg=8",
    ),
    flag(
        "n_gpu_layers",
        "-ngl --n-gpu-layers",
        0,
        "layers every engine offloads to the GPU (llama-server's -ngl; 0: none, CPU only)",
        at_least(0),
        parse=int,
    ),
    str_flag(
        "flash_attn",
        "-fa --flash-attn",
        "auto",
        "flash attention in every engine: on, off, or auto (the engine's own default)",
        _ON_OFF_AUTO,
    ),
    str_flag("engine_host", "--engine-host", "127.0.0.1", "engines listen here"),
    float_flag("drain_grace_s", "--drain-grace-s", 60.0, "SIGTERM drain limit", above(0)),
    float_flag("heartbeat_ttl_s", "--heartbeat-ttl", 10.0, "registry TTL (10)", at_least(1)),
    float_flag(
        "engine_start_timeout_s",
        "--engine-start-timeout",
        120.0,
        "seconds an engine may take to become healthy (120)",
        above(0),
    ),
    float_flag(
        "engine_stop_grace_s",
        "--engine-stop-grace",
        20.0,
        "seconds between SIGTERM and SIGKILL of an engine (20)",
        at_least(0),
    ),
    int_flag(
        "engine_give_up_after",
        "--engine-give-up-after",
        3,
        "failed starts in a row with the same error that leave an engine failed; 0: never (3)",
        at_least(0),
    ),
    float_flag("health_interval_s", "--health-interval", 5.0, "seconds (5)", above(0)),
    float_flag(
        "flush_interval_s",
        "--flush-interval",
        2.0,
        "first retry of failed uploads, doubling to 4× while the store stays down (2)",
        above(0),
    ),
    int_flag("retry_after_s", "--retry-after", 1, "Retry-After on 503s (1)"),
    LOG_FORMAT,
    LOG_LEVEL,
)

_DEFAULT = table_defaults(FLAGS)


@dataclass(frozen=True)
class NodeSettings:
    """Everything one node agent is configured with. Built once, at the edge."""

    models: tuple[str, ...]
    aliases: tuple[str, ...] = _DEFAULT["aliases"]
    roles: tuple[str, ...] = _DEFAULT["roles"]  # by --model; absent: mixed (engine_pool.protocol.handoff)
    node_id: str = _DEFAULT["node_id"]  # "" → the host name (made a valid id)
    host: str = _DEFAULT["host"]
    port: int = _DEFAULT["port"]
    n_slots: int = _DEFAULT["n_slots"]
    ctx_per_slot: int = _DEFAULT["ctx_per_slot"]
    data_dir: str = _DEFAULT["data_dir"]
    redis_url: str | None = _DEFAULT["redis_url"]
    redis_prefix: str = _DEFAULT["redis_prefix"]
    s3_endpoint: str | None = _DEFAULT["s3_endpoint"]
    s3_bucket: str | None = _DEFAULT["s3_bucket"]
    s3_prefix: str = _DEFAULT["s3_prefix"]
    s3_region: str = _DEFAULT["s3_region"]
    s3_access_key: str | None = _DEFAULT["s3_access_key"]
    s3_secret_key: str | None = _DEFAULT["s3_secret_key"]
    internal_key: str | None = _DEFAULT[
        "internal_key"
    ]  # the credential every caller of the node API (and engines) presents
    spill_bytes: int = _DEFAULT["spill_bytes"]
    spill_pending_bytes: int = _DEFAULT["spill_pending_bytes"]
    restore_bytes_in_flight: int = _DEFAULT["restore_bytes_in_flight"]
    store_compression: str = _DEFAULT[
        "store_compression"
    ]  # recurrent states and tails compressed: on, off, auto (in S3 only)
    engine_args: tuple[str, ...] = _DEFAULT["engine_args"]
    n_gpu_layers: int = _DEFAULT["n_gpu_layers"]
    flash_attn: str = _DEFAULT["flash_attn"]
    engine_host: str = _DEFAULT["engine_host"]
    drain_grace_s: float = _DEFAULT["drain_grace_s"]
    heartbeat_ttl_s: float = _DEFAULT["heartbeat_ttl_s"]
    engine_start_timeout_s: float = _DEFAULT["engine_start_timeout_s"]
    engine_stop_grace_s: float = _DEFAULT["engine_stop_grace_s"]
    # Failed starts in a row with the same error after which an engine is left failed (0: never).
    engine_give_up_after: int = _DEFAULT["engine_give_up_after"]
    health_interval_s: float = _DEFAULT["health_interval_s"]
    flush_interval_s: float = _DEFAULT["flush_interval_s"]
    retry_after_s: int = _DEFAULT["retry_after_s"]
    log_format: str = _DEFAULT["log_format"]  # console on a terminal, JSON lines otherwise
    log_level: str = _DEFAULT["log_level"]

    @property
    def model_ids(self) -> tuple[str, ...]:
        """The id each model is served as: its alias, else the file name without `.gguf`."""
        return tuple(
            self.aliases[i] if i < len(self.aliases) else Path(m).name.removesuffix(".gguf")
            for i, m in enumerate(self.models)
        )

    def role(self, index: int) -> str:
        """The role of the Nth model's engine (mixed unless --role says)."""
        return self.roles[index] if index < len(self.roles) else Role.MIXED.value

    def engine_id(self, index: int) -> str:
        return f"{self.node_id}-e{index}"

    @property
    def compresses_states(self) -> bool:
        """Whether saves store recurrent states and tails compressed (:mod:`storage.chunks.codec`):
        somewhat fewer bytes for each state a turn writes, paid in the node's CPU on save and on the
        restore's path. Off by default: decoding on the restore's path costs more than reading the
        bytes it saves from a local disk or a store on the node's own cores, and every storage
        target holds without it. ``auto`` compresses in S3 only: for a store behind a link slower
        than a core decodes, or one that bills per byte stored (figures: docs/benchmarks.md,
        "Figures formerly in code comments")."""
        return self.store_compression == "on" or (self.store_compression == "auto" and bool(self.s3_bucket))

    @property
    def data_path(self) -> Path:
        return Path(self.data_dir)

    def engine_specs(self, environ: Mapping[str, str] | None = None) -> list[EngineSpec]:
        """One engine per model: `{data_dir}/engines/{engine id}/` holds its slot dir and its log.
        `environ` (the node's) becomes each engine's environment, less the node's settings and
        secrets, plus the internal key as the engine's API key."""
        root = self.data_path / "engines"
        env = (
            None if environ is None else tuple(sorted(engine_environment(environ, self.internal_key).items()))
        )
        return [
            EngineSpec(
                engine_id=self.engine_id(i),
                model=str(Path(model).resolve()),
                model_id=self.model_ids[i],
                n_slots=self.n_slots,
                n_ctx=self.n_slots * self.ctx_per_slot,
                slot_dir=root / self.engine_id(i) / "slots",
                log_path=root / self.engine_id(i) / "engine.log",
                host=self.engine_host,
                extra_args=self.engine_args,
                n_gpu_layers=self.n_gpu_layers,
                flash_attn=self.flash_attn,
                env=env,
                role=self.role(i),
            )
            for i, model in enumerate(self.models)
        ]

    def supervisor_policy(self) -> SupervisorPolicy:
        return SupervisorPolicy(
            start_timeout_s=self.engine_start_timeout_s,
            stop_grace_s=self.engine_stop_grace_s,
            give_up_after=self.engine_give_up_after,
            health_interval_s=self.health_interval_s,
        )


_PROG = "slotkeeper node"
_DESCRIPTION = (
    "The node agent: runs one engine per --model, moves slot files between engines, the "
    "local spill cache and the blob store, and drains on SIGTERM. Every flag can also be set by its "
    "SLOTKEEPER_* variable (repeatable ones as a comma-separated list)."
)


def build_parser() -> argparse.ArgumentParser:
    return _build_parser(_PROG, _DESCRIPTION, FLAGS)


def _hostname_id() -> str:
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname()).strip("-")
    return name[:100] or "node"


def parse_node_settings(argv: Sequence[str], environ: Mapping[str, str]) -> NodeSettings:
    """Settings from a command line and an environment. Raises SettingsError with a precise message."""
    values = read_flags(argv, environ, FLAGS, prog=_PROG, description=_DESCRIPTION)
    if "models" not in values:
        raise SettingsError(f"--model is required at least once (or set {env_name('models')})")
    values.setdefault("node_id", _hostname_id())
    settings = NodeSettings(**values)
    check_settings(settings, FLAGS)
    if len(settings.aliases) > len(settings.models):
        raise SettingsError(f"{len(settings.aliases)} --alias for {len(settings.models)} --model")
    if len(settings.roles) > len(settings.models):
        raise SettingsError(f"{len(settings.roles)} --role for {len(settings.models)} --model")
    if not settings.internal_key:
        raise SettingsError(
            f"{env_name('internal_key')} is required: the node API and its engines answer only callers that "
            "present it (the gateway holds the same key)"
        )
    if bool(settings.s3_endpoint) and not settings.s3_bucket:
        raise SettingsError("--s3-endpoint needs --s3-bucket")
    return settings


def describe(settings: NodeSettings) -> dict[str, Any]:
    """The settings as loggable data (secrets are never logged)."""
    out = dataclasses.asdict(settings)
    for secret in ("s3_access_key", "s3_secret_key", "internal_key"):
        if out.get(secret):
            out[secret] = "***"
    if out.get("redis_url") and "@" in out["redis_url"]:  # redis://user:password@host
        scheme, _, rest = out["redis_url"].partition("://")
        out["redis_url"] = f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return out

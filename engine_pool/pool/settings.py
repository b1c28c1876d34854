"""Settings of one node agent (`slotkeeper node`): flags, their SLOTKEEPER_* variables, one frozen object.

`FLAGS` is the single table mapping each flag to its field and variable (command line >
environment > default); `parse_node_settings(argv, environ)` is its only reader and `node_main`
hands it `os.environ`. Repeatable flags (`--model`, `--alias`, `--engine-arg`) take their variable
as a comma-separated list. S3 credentials have variables only (a secret on a command line shows
in `ps`); without them boto3's usual chain (AWS_* variables, ~/.aws, instance roles) applies.

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

from storage.errors import InvalidId
from storage.ids import validate_id, validate_prefix

from ..credentials import engine_environment
from ..flags import (
    LOG_FORMAT,
    Check,
    Flag,
    SettingsError,
    check,
    defaults_of,
    parse_bytes,
    parse_int,
    read_flags,
)
from ..flags import build_parser as _build_parser
from .supervisor import EngineSpec, SupervisorPolicy


@dataclass(frozen=True)
class NodeSettings:
    """Everything one node agent is configured with. Built once, at the edge."""

    models: tuple[str, ...]
    aliases: tuple[str, ...] = ()
    node_id: str = ""  # "" → the host name (made a valid id)
    host: str = "127.0.0.1"
    port: int = 8070
    n_slots: int = 1
    ctx_per_slot: int = 4096
    data_dir: str = "slotkeeper-data"
    redis_url: str | None = None
    redis_prefix: str = "slotkeeper"
    s3_endpoint: str | None = None
    s3_bucket: str | None = None
    s3_prefix: str = "slotkeeper"
    s3_region: str = "us-east-1"
    s3_access_key: str | None = None
    s3_secret_key: str | None = None
    internal_key: str | None = None  # the credential every caller of the node API (and engines) presents
    spill_bytes: int = 8 << 30
    store_compression: str = "off"  # recurrent states and tails compressed: on, off, auto (in S3 only)
    engine_args: tuple[str, ...] = ()
    engine_host: str = "127.0.0.1"
    drain_grace_s: float = 60.0
    heartbeat_ttl_s: float = 10.0
    engine_start_timeout_s: float = 120.0
    engine_stop_grace_s: float = 20.0
    # Failed starts in a row with the same error after which an engine is left failed (0: never).
    engine_give_up_after: int = 3
    health_interval_s: float = 5.0
    flush_interval_s: float = 2.0
    retry_after_s: int = 1
    log_format: str = "auto"  # console on a terminal, JSON lines otherwise
    log_level: str = "info"

    @property
    def model_ids(self) -> tuple[str, ...]:
        """The id each model is served as: its alias, else the file name without `.gguf`."""
        return tuple(
            self.aliases[i] if i < len(self.aliases) else Path(m).name.removesuffix(".gguf")
            for i, m in enumerate(self.models)
        )

    def engine_id(self, index: int) -> str:
        return f"{self.node_id}-e{index}"

    @property
    def compresses_states(self) -> bool:
        """Whether saves store recurrent states and tails compressed (:mod:`storage.codec`): about
        15 % fewer bytes for each state a turn writes, for ~8.6 ms of the node's CPU a state on
        save and ~2.3 ms on the restore's path. Off by default: measured, a restore decoding its
        states ran at 0.23× a raw read of the same bytes on a local disk and at 0.44–0.79× from
        SeaweedFS on the node's own cores (0.85–1.05× without), and every storage target holds
        without it. ``auto`` compresses in S3 only: for a store behind a link slower than
        ~4 Gbit/s a decoding core, or one that bills per byte stored."""
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
                env=env,
            )  # fmt: skip
            for i, model in enumerate(self.models)
        ]

    def supervisor_policy(self) -> SupervisorPolicy:
        return SupervisorPolicy(
            start_timeout_s=self.engine_start_timeout_s,
            stop_grace_s=self.engine_stop_grace_s,
            give_up_after=self.engine_give_up_after,
            health_interval_s=self.health_interval_s,
        )


FLAGS: tuple[Flag, ...] = (
    Flag("models", ("-m", "--model"), "SLOTKEEPER_MODELS", str, "GGUF model; one engine each", repeat=True),
    Flag("aliases", ("--alias",), "SLOTKEEPER_ALIASES", str, "model id of the Nth --model", repeat=True),
    Flag("node_id", ("--node-id",), "SLOTKEEPER_NODE_ID", str, "id of this node (host name)"),
    Flag("host", ("--host",), "SLOTKEEPER_HOST", str, "address of the node API (127.0.0.1)"),
    Flag("port", ("--port",), "SLOTKEEPER_PORT", parse_int, "port of the node API (8070)"),
    Flag("n_slots", ("--slots",), "SLOTKEEPER_SLOTS", parse_int, "slots per engine (1)"),
    Flag("ctx_per_slot", ("--ctx",), "SLOTKEEPER_CTX", parse_int, "context of one slot in tokens (4096)"),
    Flag("data_dir", ("--data-dir",), "SLOTKEEPER_DATA_DIR", str, "engine slot dirs, spill cache, logs"),
    Flag("redis_url", ("--redis-url",), "SLOTKEEPER_REDIS_URL", str, "Redis (omitted: in-process index)"),
    Flag("redis_prefix", ("--redis-prefix",), "SLOTKEEPER_REDIS_PREFIX", str, "Redis key prefix"),
    Flag("s3_endpoint", ("--s3-endpoint",), "SLOTKEEPER_S3_ENDPOINT", str, "S3 endpoint URL"),
    Flag("s3_bucket", ("--s3-bucket",), "SLOTKEEPER_S3_BUCKET", str, "S3 bucket (omitted: local store)"),
    Flag("s3_prefix", ("--s3-prefix",), "SLOTKEEPER_S3_PREFIX", str, "blob key prefix (slotkeeper)"),
    Flag("s3_region", ("--s3-region",), "SLOTKEEPER_S3_REGION", str, "S3 region (us-east-1)"),
    Flag("s3_access_key", (), "SLOTKEEPER_S3_ACCESS_KEY", str, "S3 access key"),
    Flag("s3_secret_key", (), "SLOTKEEPER_S3_SECRET_KEY", str, "S3 secret key"),
    Flag(
        "internal_key", (), "SLOTKEEPER_INTERNAL_KEY", str, "the credential the gateway presents (required)"
    ),
    Flag("spill_bytes", ("--spill-bytes",), "SLOTKEEPER_SPILL_BYTES", parse_bytes, "spill cache budget (8G)"),
    Flag(
        "store_compression",
        ("--store-compression",),
        "SLOTKEEPER_STORE_COMPRESSION",
        str,
        "store recurrent states compressed: on, off (default), auto (on in S3, off on a local disk)",
    ),  # fmt: skip
    Flag(
        "engine_args",
        ("--engine-arg",),
        "SLOTKEEPER_ENGINE_ARGS",
        str,
        "one more argument for every engine, e.g. --engine-arg=--ctx-checkpoints --engine-arg=8",
        repeat=True,
    ),
    Flag("engine_host", ("--engine-host",), "SLOTKEEPER_ENGINE_HOST", str, "engines listen here"),
    Flag("drain_grace_s", ("--drain-grace-s",), "SLOTKEEPER_DRAIN_GRACE_S", float, "SIGTERM drain limit"),
    Flag("heartbeat_ttl_s", ("--heartbeat-ttl",), "SLOTKEEPER_HEARTBEAT_TTL", float, "registry TTL (10)"),
    Flag(
        "engine_start_timeout_s",
        ("--engine-start-timeout",),
        "SLOTKEEPER_ENGINE_START_TIMEOUT",
        float,
        "seconds an engine may take to become healthy (120)",
    ),
    Flag(
        "engine_stop_grace_s",
        ("--engine-stop-grace",),
        "SLOTKEEPER_ENGINE_STOP_GRACE",
        float,
        "seconds between SIGTERM and SIGKILL of an engine (20)",
    ),
    Flag(
        "engine_give_up_after",
        ("--engine-give-up-after",),
        "SLOTKEEPER_ENGINE_GIVE_UP_AFTER",
        parse_int,
        "failed starts in a row with the same error that leave an engine failed; 0: never (3)",
    ),
    Flag("health_interval_s", ("--health-interval",), "SLOTKEEPER_HEALTH_INTERVAL", float, "seconds (5)"),
    Flag(
        "flush_interval_s",
        ("--flush-interval",),
        "SLOTKEEPER_FLUSH_INTERVAL",
        float,
        "first retry of failed uploads, doubling to 16× while the store stays down (2)",
    ),
    Flag("retry_after_s", ("--retry-after",), "SLOTKEEPER_RETRY_AFTER", parse_int, "Retry-After on 503s (1)"),
    LOG_FORMAT,
    Flag("log_level", ("--log-level",), "SLOTKEEPER_LOG_LEVEL", str, "debug, info, warning, error"),
)


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


# Checked after parsing: (field, predicate, what it must be).
_CHECKS: tuple[Check, ...] = (
    ("models", lambda v: len(v) >= 1, "given at least once"),
    ("aliases", _ids, "valid ids (letters, digits, '-_.~@+=')"),
    ("node_id", lambda v: _ids((v,)), "a valid id (letters, digits, '-_.~@+=')"),
    ("port", lambda v: 0 <= v <= 65535, "within 0..65535"),
    ("n_slots", lambda v: 1 <= v <= 256, "within 1..256"),
    ("ctx_per_slot", lambda v: v >= 16, "at least 16"),
    ("s3_prefix", _prefix, "'/'-separated valid ids"),
    ("spill_bytes", lambda v: v >= 0, ">= 0"),
    ("store_compression", lambda v: v in ("on", "off", "auto"), "on, off or auto"),
    ("drain_grace_s", lambda v: v > 0, "> 0"),
    ("heartbeat_ttl_s", lambda v: v >= 1, ">= 1"),
    ("engine_start_timeout_s", lambda v: v > 0, "> 0"),
    ("engine_stop_grace_s", lambda v: v >= 0, ">= 0"),
    ("engine_give_up_after", lambda v: v >= 0, ">= 0"),
    ("health_interval_s", lambda v: v > 0, "> 0"),
    ("flush_interval_s", lambda v: v > 0, "> 0"),
    ("log_level", lambda v: v in ("debug", "info", "warning", "error"), "debug, info, warning or error"),
)


_PROG = "slotkeeper node"
_DESCRIPTION = (
    "The node agent: runs one engine per --model, moves slot files between engines, the "
    "local spill cache and the blob store, and drains on SIGTERM. Every flag can also be set by its "
    "SLOTKEEPER_* variable (repeatable ones as a comma-separated list)."
)


def build_parser() -> argparse.ArgumentParser:
    return _build_parser(_PROG, _DESCRIPTION, FLAGS, defaults_of(NodeSettings))


def _hostname_id() -> str:
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname()).strip("-")
    return name[:100] or "node"


def parse_node_settings(argv: Sequence[str], environ: Mapping[str, str]) -> NodeSettings:
    """Settings from a command line and an environment. Raises SettingsError with a precise message."""
    values = read_flags(
        argv, environ, FLAGS, prog=_PROG, description=_DESCRIPTION, defaults=defaults_of(NodeSettings)
    )
    if "models" not in values:
        raise SettingsError("--model is required at least once (or set SLOTKEEPER_MODELS)")
    values.setdefault("node_id", _hostname_id())
    settings = NodeSettings(**values)
    check(settings, FLAGS, _CHECKS)
    if len(settings.aliases) > len(settings.models):
        raise SettingsError(f"{len(settings.aliases)} --alias for {len(settings.models)} --model")
    if not settings.internal_key:
        raise SettingsError(
            "SLOTKEEPER_INTERNAL_KEY is required: the node API and its engines answer only callers that "
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

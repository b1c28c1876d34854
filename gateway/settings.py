"""The gateway's settings: one frozen object built at the edge from flags and SLOTKEEPER_* env.

`FLAGS` is the one table mapping each flag to its field and variable (engine_pool.flags reads it:
command line > environment > default). Nothing else reads the environment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine_pool.body import BodyLimits
from engine_pool.flags import (
    LOG_FORMAT,
    Check,
    Flag,
    SettingsError,
    check,
    defaults_of,
    parse_bool,
    parse_bytes,
    parse_int,
    parse_list,
    read_flags,
    values_from,
)

__all__ = ["FLAGS", "GatewaySettings", "SettingsError", "parse_settings", "settings_from_args"]


@dataclass(frozen=True)
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 8000
    nodes: tuple[str, ...] = ()  # node agent URLs
    redis_url: str | None = None  # None: the in-process index (one machine only)
    redis_prefix: str = "slotkeeper"
    tenants: str | None = None  # tenants TOML; None: one open default tenant
    s3_endpoint: str | None = None
    s3_bucket: str | None = None
    s3_prefix: str = "slotkeeper"
    s3_region: str = "us-east-1"
    s3_access_key: str | None = None  # variables only: a secret on a command line shows in `ps`
    s3_secret_key: str | None = None
    internal_key: str | None = None  # presented to node agents and engines (variable only)
    data_dir: str = ".slotkeeper"
    # Short, and renewed every third of it while a turn runs: a dead gateway frees its sessions fast.
    lock_ttl_s: float = 15.0
    spill_wait_s: float = 30.0  # a request waits this long for its session's write-behind save
    # A write-behind save starts this long after its turn's answer: an agent's next turn sent at
    # once (a fast tool) runs first, not beside the save, and the save that follows it is the newer.
    save_grace_s: float = 0.1
    # A turn whose session this gateway holds locked is sent to its slot beside its opening read,
    # not after it (gateway.early): the read's round trip leaves the turn's latency.
    early_start: bool = True
    keep_generations: int = 2  # stored generations kept per session (the newest K)
    collect_interval_s: float = 300.0  # chunk collection and idle-session expiry, per tenant
    request_timeout_s: float = 600.0  # an engine silent this long fails that request (only)
    # Limits at the edge (each a precise 4xx): body bytes (413), JSON nesting (400), body and header
    # read time (408 / connection closed), requests running at once per tenant (429).
    max_body_bytes: int = 16 << 20
    max_json_depth: int = 64
    max_messages: int = 4096
    body_timeout_s: float = 60.0
    header_timeout_s: float = 10.0
    # Longer than clients keep idle connections (httpx, the OpenAI SDK: 5 s), so that the client, not
    # the server, ends an idle connection: never one the client is sending a request on at that moment.
    keep_alive_s: float = 30.0
    max_inflight: int = 64  # per tenant, unless its quotas say otherwise
    # The output cap of a request that sets no max_tokens, unless its tenant says otherwise (0: none):
    # a model that never ends its turn must not hold a slot until the end of its context.
    default_max_tokens: int = 8192
    # Engines a placement looks at (a random sample, plus the tenant's own): routing costs the same
    # whatever the pool's size. Pools this size or smaller are looked at whole.
    placement_sample: int = 8
    log_level: str = "info"
    log_format: str = "auto"  # console on a terminal, JSON lines otherwise
    # Origins whose pages may call the API (CORS), comma-separated: * any, localhost only this machine's.
    cors_origins: str = "*"

    def body_limits(self) -> BodyLimits:
        return BodyLimits(self.max_body_bytes, self.max_json_depth, self.body_timeout_s)


FLAGS: tuple[Flag, ...] = (
    Flag("host", ("--host",), "SLOTKEEPER_HOST", str, "listen address (127.0.0.1)"),
    Flag("port", ("--port",), "SLOTKEEPER_PORT", parse_int, "listen port (8000)"),
    Flag("nodes", ("--node",), "SLOTKEEPER_NODES", str, "node agent URL (repeatable)", repeat=True),
    Flag("redis_url", ("--redis-url",), "SLOTKEEPER_REDIS_URL", str, "Redis URL (default: in-process index)"),
    Flag("redis_prefix", ("--redis-prefix",), "SLOTKEEPER_REDIS_PREFIX", str, "prefix of every Redis key"),
    Flag(
        "tenants", ("--tenants",), "SLOTKEEPER_TENANTS", str, "tenants TOML file (default: one open tenant)"
    ),
    Flag("s3_endpoint", ("--s3-endpoint",), "SLOTKEEPER_S3_ENDPOINT", str, "S3 endpoint URL"),
    Flag("s3_bucket", ("--s3-bucket",), "SLOTKEEPER_S3_BUCKET", str, "S3 bucket (default: a local store)"),
    Flag("s3_prefix", ("--s3-prefix",), "SLOTKEEPER_S3_PREFIX", str, "key prefix in the bucket"),
    Flag("s3_region", ("--s3-region",), "SLOTKEEPER_S3_REGION", str, "S3 region (us-east-1)"),
    Flag("s3_access_key", (), "SLOTKEEPER_S3_ACCESS_KEY", str, "S3 access key (else boto3's chain)"),
    Flag("s3_secret_key", (), "SLOTKEEPER_S3_SECRET_KEY", str, "S3 secret key (else boto3's chain)"),
    Flag("internal_key", (), "SLOTKEEPER_INTERNAL_KEY", str, "credential for node agents and engines"),
    Flag("data_dir", ("--data-dir",), "SLOTKEEPER_DATA_DIR", str, "local state directory (.slotkeeper)"),
    Flag("lock_ttl_s", ("--lock-ttl-s",), "SLOTKEEPER_LOCK_TTL_S", float, "session lock TTL, seconds"),
    Flag("spill_wait_s", ("--spill-wait-s",), "SLOTKEEPER_SPILL_WAIT_S", float, "wait for a session's save"),
    Flag(
        "save_grace_s",
        ("--save-grace-s",),
        "SLOTKEEPER_SAVE_GRACE_S",
        float,
        "seconds between a turn's answer and its write-behind save (0.1)",
    ),  # fmt: skip
    Flag(
        "early_start",
        ("--early-start",),
        "SLOTKEEPER_EARLY_START",
        parse_bool,
        "on|off: send a warm turn whose session this gateway holds locked beside its opening read (on)",
    ),
    Flag(
        "keep_generations",
        ("--keep-generations",),
        "SLOTKEEPER_KEEP_GENERATIONS",
        int,
        "stored generations kept per session (2)",
    ),
    Flag(
        "collect_interval_s",
        ("--collect-interval-s",),
        "SLOTKEEPER_COLLECT_INTERVAL_S",
        float,
        "seconds between chunk collections and idle-session expiry (300; 0 = never)",
    ),
    Flag(
        "request_timeout_s", ("--request-timeout-s",), "SLOTKEEPER_REQUEST_TIMEOUT_S", float, "engine timeout"
    ),
    Flag(
        "max_body_bytes", ("--max-body-bytes",), "SLOTKEEPER_MAX_BODY_BYTES", parse_bytes, "body limit (16M)"
    ),
    Flag(
        "max_json_depth", ("--max-json-depth",), "SLOTKEEPER_MAX_JSON_DEPTH", parse_int, "JSON nesting (64)"
    ),
    Flag("max_messages", ("--max-messages",), "SLOTKEEPER_MAX_MESSAGES", parse_int, "messages per request"),
    Flag("body_timeout_s", ("--body-timeout-s",), "SLOTKEEPER_BODY_TIMEOUT_S", float, "body read limit (60)"),
    Flag(
        "header_timeout_s", ("--header-timeout-s",), "SLOTKEEPER_HEADER_TIMEOUT_S", float, "header read limit"
    ),
    Flag("keep_alive_s", ("--keep-alive-s",), "SLOTKEEPER_KEEP_ALIVE_S", float, "idle connection limit (30)"),
    Flag(
        "max_inflight", ("--max-inflight",), "SLOTKEEPER_MAX_INFLIGHT", parse_int, "running requests/tenant"
    ),
    Flag(
        "default_max_tokens",
        ("--default-max-tokens",),
        "SLOTKEEPER_DEFAULT_MAX_TOKENS",
        parse_int,
        "output cap of a request that sets no max_tokens; 0: none (8192)",
    ),
    Flag(
        "placement_sample",
        ("--placement-sample",),
        "SLOTKEEPER_PLACEMENT_SAMPLE",
        parse_int,
        "engines one placement looks at, sampled (8)",
    ),
    Flag("log_level", ("--log-level",), "SLOTKEEPER_LOG_LEVEL", str, "debug|info|warning|error"),
    LOG_FORMAT,
    Flag(
        "cors_origins",
        ("--cors-origins",),
        "SLOTKEEPER_CORS_ORIGINS",
        str,
        "origins whose pages may call the API, comma-separated: * any, localhost this machine's (*)",
    ),
)

_CHECKS: tuple[Check, ...] = (
    ("port", lambda v: 0 < v < 65536, "a TCP port"),
    ("lock_ttl_s", lambda v: v > 0, "> 0"),
    ("spill_wait_s", lambda v: v >= 0, ">= 0"),
    ("save_grace_s", lambda v: 0 <= v <= 10, "within 0..10"),
    ("keep_generations", lambda v: v >= 1, ">= 1"),
    ("collect_interval_s", lambda v: v >= 0, ">= 0"),
    ("request_timeout_s", lambda v: v > 0, "> 0"),
    ("max_body_bytes", lambda v: v >= 1024, ">= 1024"),
    ("max_json_depth", lambda v: 4 <= v <= 512, "within 4..512"),
    ("max_messages", lambda v: v >= 1, ">= 1"),
    ("body_timeout_s", lambda v: v > 0, "> 0"),
    ("header_timeout_s", lambda v: v > 0, "> 0"),
    ("keep_alive_s", lambda v: v > 0, "> 0"),
    ("max_inflight", lambda v: v >= 1, ">= 1"),
    ("default_max_tokens", lambda v: 0 <= v < 2**31, "within 0..2^31-1"),
    ("placement_sample", lambda v: v >= 1, ">= 1"),
    ("log_level", lambda v: v in ("debug", "info", "warning", "error"), "debug, info, warning or error"),
    ("cors_origins", lambda v: bool(parse_list(v)), "*, localhost or one or more origins"),
)


def settings_from_args(args: Mapping[str, Any], environ: Mapping[str, str]) -> GatewaySettings:
    """From parsed arguments (a parser that `engine_pool.flags.add_flags` filled) and the environment."""
    settings = GatewaySettings(**values_from(args, FLAGS, environ))
    check(settings, FLAGS, _CHECKS)
    return settings


def parse_settings(argv: Sequence[str], environ: Mapping[str, str]) -> GatewaySettings:
    defaults = defaults_of(GatewaySettings)
    values = read_flags(
        argv, environ, FLAGS, prog="slotkeeper gateway", description=__doc__ or "", defaults=defaults
    )
    settings = GatewaySettings(**values)
    check(settings, FLAGS, _CHECKS)
    return settings

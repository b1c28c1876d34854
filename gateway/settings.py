"""The gateway's settings: one frozen object built at the edge from flags and SLOTKEEPER_* env.

`FLAGS` is the one table: each row holds a setting's flag, default and check, and its variable is
SLOTKEEPER_ + the field's name (engine_pool.process.flags reads it: command line > environment >
default). The limits an engine enforces too are rows of `engine_pool.process.limit_flags`. Nothing
else reads the environment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine_pool.http.body import BodyLimits
from engine_pool.process.flags import (
    LOG_FORMAT,
    LOG_LEVEL,
    S3_ENDPOINT,
    Flag,
    SettingsError,
    above,
    at_least,
    bool_flag,
    check_settings,
    flag,
    float_flag,
    int_flag,
    list_flag,
    parse_list,
    read_flags,
    str_flag,
    table_defaults,
    values_from,
    within,
)
from engine_pool.process.limit_flags import BODY_TIMEOUT_S, MAX_BODY_BYTES, MAX_JSON_DEPTH, MAX_MESSAGES
from engine_pool.protocol.handoff import HANDOFF_MODES, parse_threshold

__all__ = ["FLAGS", "GatewaySettings", "SettingsError", "parse_settings", "settings_from_args"]
from storage.index.prefix_digests import DEFAULT_ROUTES_PER_SESSION
from storage.index.topology import redis_url_check

REDIS_URL = redis_url_check()


FLAGS: tuple[Flag, ...] = (
    str_flag("host", "--host", "127.0.0.1", "listen address (127.0.0.1)"),
    int_flag("port", "--port", 8000, "listen port (8000)", (lambda v: 0 < v < 65536, "a TCP port")),
    list_flag("nodes", "--node", "node agent URL (repeatable)"),
    str_flag(
        "redis_url",
        "--redis-url",
        None,
        "Redis URL: redis://, rediss://, redis-cluster://, redis-sentinel:// (default: in-process index)",
        REDIS_URL,
    ),
    str_flag("redis_prefix", "--redis-prefix", "slotkeeper", "prefix of every Redis key"),
    int_flag(
        "routes_per_session",
        "--routes-per-session",
        DEFAULT_ROUTES_PER_SESSION,
        "implicit-routing keys a session keeps: its newest complete turns, its last head and "
        f"prompt; a request going back further starts a new session ({DEFAULT_ROUTES_PER_SESSION})",
        at_least(2),
    ),
    str_flag("tenants", "--tenants", None, "tenants TOML file (default: one open tenant)"),
    str_flag("s3_endpoint", "--s3-endpoint", None, "S3 endpoint URL", S3_ENDPOINT),
    str_flag("s3_bucket", "--s3-bucket", None, "S3 bucket (default: a local store)"),
    str_flag("s3_prefix", "--s3-prefix", "slotkeeper", "key prefix in the bucket"),
    str_flag("s3_region", "--s3-region", "us-east-1", "S3 region (us-east-1)"),
    str_flag("s3_access_key", "", None, "S3 access key (else boto3's chain)"),
    str_flag("s3_secret_key", "", None, "S3 secret key (else boto3's chain)"),
    str_flag("internal_key", "", None, "credential for node agents and engines"),
    # Variable only, like the internal key (a secret on a command line shows in `ps`).
    str_flag("sealing_key", "", None, "key sealing store:false reasoning (default: from the internal key)"),
    str_flag("data_dir", "--data-dir", ".slotkeeper", "local state directory (.slotkeeper)"),
    float_flag("lock_ttl_s", "--lock-ttl-s", 15.0, "session lock TTL, seconds", above(0)),
    float_flag("spill_wait_s", "--spill-wait-s", 30.0, "wait for a session's save", at_least(0)),
    float_flag(
        "save_grace_s",
        "--save-grace-s",
        0.1,
        "seconds a turn's hold is kept after its answer for a next turn; a save starts after it (0.1)",
        within(0, 10),
    ),
    str_flag(
        "handoff",
        "--handoff",
        "logits",
        "what a split turn hands its decode engine: logits (the whole prompt's state and its last "
        "logits: the decode side evaluates no prompt token) or last-token (all but the last token, "
        "which the decode side evaluates: the usual design, for comparison) (logits)",
        (lambda v: v in HANDOFF_MODES, f"one of {', '.join(HANDOFF_MODES)}"),
    ),
    flag(
        "handoff_threshold",
        "--handoff-threshold",
        2048,
        "uncached prompt tokens from which a turn is prefilled on a prefill engine of its model, for "
        "tenants that set no handoff_threshold: a number, 0 (always) or off (2048)",
        (lambda v: v is None or v >= 0, "a number of tokens, or off"),
        parse=parse_threshold,
    ),
    float_flag(
        "handoff_wait_s",
        "--handoff-wait-s",
        2.0,
        "seconds a split turn waits for a free prefill slot; then it runs unsplit (2)",
        within(0, 600),
    ),
    float_flag(
        "handoff_timeout_s",
        "--handoff-timeout-s",
        300.0,
        "seconds a split turn's prefill may take on the prefill engine; then it is cancelled there "
        "and the turn runs unsplit (300)",
        within(1, 3600),
    ),
    bool_flag(
        "early_start",
        "--early-start",
        True,
        "on|off: send a warm turn whose session this gateway holds locked beside its opening read (on)",
    ),
    flag(
        "keep_generations",
        "--keep-generations",
        2,
        "stored generations kept per session (2)",
        at_least(1),
        parse=int,
    ),
    float_flag(
        "collect_interval_s",
        "--collect-interval-s",
        300.0,
        "seconds between chunk collections and idle-session expiry (300; 0 = never)",
        at_least(0),
    ),
    float_flag("request_timeout_s", "--request-timeout-s", 600.0, "engine timeout", above(0)),
    MAX_BODY_BYTES.with_help("body limit (16M)"),
    MAX_JSON_DEPTH.with_help("JSON nesting (64)"),
    MAX_MESSAGES.with_help("messages per request"),
    BODY_TIMEOUT_S.with_help("body read limit (60)"),
    float_flag("header_timeout_s", "--header-timeout-s", 10.0, "header read limit", above(0)),
    float_flag("keep_alive_s", "--keep-alive-s", 30.0, "idle connection limit (30)", above(0)),
    int_flag("max_inflight", "--max-inflight", 64, "running requests/tenant", at_least(1)),
    int_flag(
        "default_max_tokens",
        "--default-max-tokens",
        8192,
        "output cap of a request that sets no max_tokens; 0: none (8192)",
        (lambda v: 0 <= v < 2**31, "within 0..2^31-1"),
    ),
    int_flag(
        "placement_sample",
        "--placement-sample",
        8,
        "engines one placement looks at, sampled (8)",
        at_least(1),
    ),
    LOG_LEVEL.with_help("debug|info|warning|error"),
    LOG_FORMAT,
    str_flag(
        "cors_origins",
        "--cors-origins",
        "*",
        "origins whose pages may call the API, comma-separated: * any, localhost this machine's (*)",
        (lambda v: bool(parse_list(v)), "*, localhost or one or more origins"),
    ),
)

_DEFAULT = table_defaults(FLAGS)


@dataclass(frozen=True)
class GatewaySettings:
    host: str = _DEFAULT["host"]
    port: int = _DEFAULT["port"]
    nodes: tuple[str, ...] = _DEFAULT["nodes"]  # node agent URLs
    redis_url: str | None = _DEFAULT["redis_url"]  # None: the in-process index (one machine only)
    redis_prefix: str = _DEFAULT["redis_prefix"]
    routes_per_session: int = _DEFAULT["routes_per_session"]  # storage.index.prefix_digests
    tenants: str | None = _DEFAULT["tenants"]  # tenants TOML; None: one open default tenant
    s3_endpoint: str | None = _DEFAULT["s3_endpoint"]
    s3_bucket: str | None = _DEFAULT["s3_bucket"]
    s3_prefix: str = _DEFAULT["s3_prefix"]
    s3_region: str = _DEFAULT["s3_region"]
    s3_access_key: str | None = _DEFAULT[
        "s3_access_key"
    ]  # variables only: a secret on a command line shows in `ps`
    s3_secret_key: str | None = _DEFAULT["s3_secret_key"]
    internal_key: str | None = _DEFAULT[
        "internal_key"
    ]  # presented to node agents and engines (variable only)
    # Seals reasoning for Responses clients that store nothing (gateway.sealing); None: derived from
    # the internal key (`slotkeeper serve`: one kept in the data directory). Variable only.
    sealing_key: str | None = _DEFAULT["sealing_key"]
    data_dir: str = _DEFAULT["data_dir"]
    # Short, and renewed every third of it while a turn runs: a dead gateway frees its sessions fast.
    lock_ttl_s: float = _DEFAULT["lock_ttl_s"]
    spill_wait_s: float = _DEFAULT[
        "spill_wait_s"
    ]  # a request waits this long for its session's write-behind save
    # A write-behind save starts this long after its turn's answer: an agent's next turn sent at
    # once (a fast tool) runs first, not beside the save, and the save that follows it is the newer.
    save_grace_s: float = _DEFAULT["save_grace_s"]
    # A turn whose session this gateway holds locked is sent to its slot beside its opening read,
    # not after it (gateway.turn.early): the read's round trip leaves the turn's latency.
    early_start: bool = _DEFAULT["early_start"]
    # The prefill/decode split (gateway.turn.handoff): what is handed over, from how long an uncached
    # tail (None: never), how long a turn waits for a prefill slot, and how long its prefill may take.
    handoff: str = _DEFAULT["handoff"]
    handoff_threshold: int | None = _DEFAULT["handoff_threshold"]
    handoff_wait_s: float = _DEFAULT["handoff_wait_s"]
    handoff_timeout_s: float = _DEFAULT["handoff_timeout_s"]
    keep_generations: int = _DEFAULT["keep_generations"]  # stored generations kept per session (the newest K)
    collect_interval_s: float = _DEFAULT[
        "collect_interval_s"
    ]  # chunk collection and idle-session expiry, per tenant
    request_timeout_s: float = _DEFAULT[
        "request_timeout_s"
    ]  # an engine silent this long fails that request (only)
    # Limits at the edge (each a precise 4xx): body bytes (413), JSON nesting (400), body and header
    # read time (408 / connection closed), requests running at once per tenant (429).
    max_body_bytes: int = _DEFAULT["max_body_bytes"]
    max_json_depth: int = _DEFAULT["max_json_depth"]
    max_messages: int = _DEFAULT["max_messages"]
    body_timeout_s: float = _DEFAULT["body_timeout_s"]
    header_timeout_s: float = _DEFAULT["header_timeout_s"]
    # Longer than clients keep idle connections (httpx, the OpenAI SDK: 5 s), so that the client, not
    # the server, ends an idle connection: never one the client is sending a request on at that moment.
    keep_alive_s: float = _DEFAULT["keep_alive_s"]
    max_inflight: int = _DEFAULT["max_inflight"]  # per tenant, unless its quotas say otherwise
    # The output cap of a request that sets no max_tokens, unless its tenant says otherwise (0: none):
    # a model that never ends its turn must not hold a slot until the end of its context.
    default_max_tokens: int = _DEFAULT["default_max_tokens"]
    # Engines a placement looks at (a random sample, plus the tenant's own): routing costs the same
    # whatever the pool's size. Pools this size or smaller are looked at whole.
    placement_sample: int = _DEFAULT["placement_sample"]
    log_level: str = _DEFAULT["log_level"]
    log_format: str = _DEFAULT["log_format"]  # console on a terminal, JSON lines otherwise
    # Origins whose pages may call the API (CORS), comma-separated: * any, localhost only this machine's.
    cors_origins: str = _DEFAULT["cors_origins"]

    def body_limits(self) -> BodyLimits:
        return BodyLimits(self.max_body_bytes, self.max_json_depth, self.body_timeout_s)


def settings_from_args(args: Mapping[str, Any], environ: Mapping[str, str]) -> GatewaySettings:
    """From parsed arguments (a parser that `engine_pool.process.flags.add_flags` filled) and the
    environment."""
    settings = GatewaySettings(**values_from(args, FLAGS, environ))
    check_settings(settings, FLAGS)
    return settings


def parse_settings(argv: Sequence[str], environ: Mapping[str, str]) -> GatewaySettings:
    values = read_flags(argv, environ, FLAGS, prog="slotkeeper gateway", description=__doc__ or "")
    settings = GatewaySettings(**values)
    check_settings(settings, FLAGS)
    return settings

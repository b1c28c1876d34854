"""The gateway's settings: one frozen object built at the edge from flags and SLOTKEEPER_* env.

`FLAGS` is the one table mapping each flag to its field, environment variable and type; the command
line wins over the environment, which wins over the default. Nothing else reads the environment.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any


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
    data_dir: str = ".slotkeeper"
    lock_ttl_s: float = 600.0
    spill_wait_s: float = 30.0  # a request waits this long for its session's write-behind save
    request_timeout_s: float = 600.0
    log_level: str = "info"
    extra: dict[str, Any] = field(default_factory=dict)


# flag, field, env, type, help
FLAGS: list[tuple[str, str, str, Any, str]] = [
    ("--host", "host", "SLOTKEEPER_HOST", str, "listen address"),
    ("--port", "port", "SLOTKEEPER_PORT", int, "listen port"),
    ("--node", "nodes", "SLOTKEEPER_NODES", "list", "node agent URL (repeatable; env: comma-separated)"),
    ("--redis-url", "redis_url", "SLOTKEEPER_REDIS_URL", str, "Redis URL (default: in-process index)"),
    ("--redis-prefix", "redis_prefix", "SLOTKEEPER_REDIS_PREFIX", str, "prefix of every Redis key"),
    ("--tenants", "tenants", "SLOTKEEPER_TENANTS", str, "tenants TOML file (default: one open tenant)"),
    ("--s3-endpoint", "s3_endpoint", "SLOTKEEPER_S3_ENDPOINT", str, "S3 endpoint URL"),
    ("--s3-bucket", "s3_bucket", "SLOTKEEPER_S3_BUCKET", str, "S3 bucket"),
    ("--s3-prefix", "s3_prefix", "SLOTKEEPER_S3_PREFIX", str, "key prefix in the bucket"),
    ("--data-dir", "data_dir", "SLOTKEEPER_DATA_DIR", str, "local state directory"),
    ("--lock-ttl-s", "lock_ttl_s", "SLOTKEEPER_LOCK_TTL_S", float, "session lock TTL"),
    ("--spill-wait-s", "spill_wait_s", "SLOTKEEPER_SPILL_WAIT_S", float, "wait for a session's save"),
    ("--request-timeout-s", "request_timeout_s", "SLOTKEEPER_REQUEST_TIMEOUT_S", float, "engine timeout"),
    ("--log-level", "log_level", "SLOTKEEPER_LOG_LEVEL", str, "debug|info|warning|error"),
]


class SettingsError(ValueError):
    pass


def _convert(kind: Any, raw: str, flag: str) -> Any:
    if kind == "list":
        return tuple(x for x in (s.strip() for s in raw.split(",")) if x)
    try:
        return kind(raw)
    except ValueError:
        raise SettingsError(f"{flag}: {raw!r} is not a valid {kind.__name__}") from None


def add_flags(parser: argparse.ArgumentParser, skip: frozenset[str] = frozenset()) -> None:
    for flag, name, env, kind, help_ in FLAGS:
        if name in skip:
            continue
        if kind == "list":
            parser.add_argument(flag, dest=name, action="append", help=f"{help_} [{env}]")
        else:
            parser.add_argument(flag, dest=name, help=f"{help_} [{env}]")


def settings_from(ns: argparse.Namespace, environ: Mapping[str, str]) -> GatewaySettings:
    values: dict[str, Any] = {}
    known = {f.name for f in fields(GatewaySettings)}
    for flag, name, env, kind, _ in FLAGS:
        assert name in known
        raw = getattr(ns, name, None)
        if raw is not None:
            values[name] = tuple(raw) if kind == "list" else _convert(kind, raw, flag)
        elif env in environ:
            values[name] = _convert(kind, environ[env], env)
    return GatewaySettings(**values)


def parse_settings(argv: Sequence[str], environ: Mapping[str, str], prog: str = "slotkeeper gateway"):
    parser = argparse.ArgumentParser(prog=prog)
    add_flags(parser)
    return settings_from(parser.parse_args(list(argv)), environ)

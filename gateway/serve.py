"""`slotkeeper serve`: everything on one machine in one process — the gateway, a node agent and
its engine processes — sharing one session index (in-process unless --redis-url is given) and one
blob store (a directory under --data-dir unless --s3-bucket is given).

Without --model a tiny random-weight qwen35 is generated, with a loud warning: it answers in
gibberish and exists so that `slotkeeper serve` works out of the box. A --model that is no readable
GGUF file stops it before anything starts: one line on stderr per bad model, exit code 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import redis.asyncio as aioredis
import structlog
import uvicorn

from engine_pool.common import logs
from engine_pool.common import loop as event_loop
from engine_pool.common.credentials import new_key
from engine_pool.common.flags import add_flags, env_name
from engine_pool.common.http_deadlines import header_deadline
from engine_pool.pool.main import build_server
from engine_pool.pool.model_check import check_models
from engine_pool.pool.settings import parse_node_settings
from gateway.app import build_app
from gateway.main import services
from gateway.metrics import Metrics
from gateway.settings import FLAGS, SettingsError, settings_from_args
from gateway.tenants import TenantConfigError, load_tenants
from native.model_gen import cached_model
from storage.index.session_index import in_process_redis

log = structlog.get_logger("slotkeeper.serve")


class _QuietServer(uvicorn.Server):
    """The gateway's server: signals belong to the node server, which drains and then ends both."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


# What a person starting serve reaches for first; then where state lives; then everything else.
_FIRST = ("host", "port", "data_dir", "tenants", "default_max_tokens", "log_format", "log_level")
_STORAGE = ("redis_url", "redis_prefix", "s3_endpoint", "s3_bucket", "s3_prefix", "s3_region")


def _parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """serve's flags in three groups; its own (model, slots, context, node port, compression) read
    their SLOTKEEPER_* variable too, and every help line names its default and variable."""
    ap = argparse.ArgumentParser(prog="slotkeeper serve", description=__doc__)
    by_field = {f.field: f for f in FLAGS if f.field != "nodes"}  # (its node is the one it runs)
    first = ap.add_argument_group("what to serve and where")
    first.add_argument(
        "--model",
        action="append",
        help="GGUF model, repeatable (default: a tiny demo model that answers gibberish) "
        f"[env {env_name('models')}, comma-separated]",
    )
    first.add_argument(
        "--slots",
        default=environ.get(env_name("slots"), "2"),
        help=f"slots (sessions live at once) per engine (default 2) [env {env_name('slots')}]",
    )
    first.add_argument(
        "--ctx",
        default=environ.get(env_name("ctx"), "8192"),
        help=f"context per slot, in tokens (default 8192) [env {env_name('ctx')}]",
    )
    add_flags(first, [by_field[f] for f in _FIRST])
    storage = ap.add_argument_group("state: index and store")
    add_flags(storage, [by_field[f] for f in _STORAGE])
    rest = ap.add_argument_group("limits and tuning")
    rest.add_argument(
        "--node-port",
        type=int,
        default=int(environ.get(env_name("node_port"), "0")),
        help=f"node agent port (default: --port + 1) [env {env_name('node_port')}]",
    )
    rest.add_argument(
        "--store-compression",
        choices=("on", "off", "auto"),
        default=environ.get(env_name("store_compression"), "off"),
        help="store recurrent states compressed; auto: in S3 only (default off) "
        f"[env {env_name('store_compression')}]",
    )
    others = [f for name, f in by_field.items() if name not in _FIRST + _STORAGE]
    add_flags(rest, others)
    ap.set_defaults(env_models=[m for m in environ.get(env_name("models"), "").split(",") if m])
    return ap


async def _run(node_server: uvicorn.Server, gateway_server: uvicorn.Server) -> None:
    gateway = asyncio.create_task(gateway_server.serve())
    try:
        await node_server.serve()  # returns after a SIGTERM drain (or a start failure)
    finally:
        gateway_server.should_exit = True
        await gateway


def main(argv: list[str]) -> int:
    ns = _parser(os.environ).parse_args(argv)
    try:
        settings = settings_from_args(vars(ns), os.environ)
        load_tenants(settings.tenants)
    except (SettingsError, TenantConfigError) as exc:
        print(f"slotkeeper serve: {exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_format, settings.log_level)
    data = Path(settings.data_dir)
    models = ns.model or ns.env_models
    if not models:
        models = [cached_model(data / "models", "qwen35", size="tiny")]
        warning = "no --model given: serving a TINY RANDOM-WEIGHT qwen35 that answers gibberish"
        log.warning("serve.demo_model", model=models[0], warning=warning)
        print(f"WARNING: {warning} ({models[0]})", file=sys.stderr)
    bad_models = check_models(models)
    for line in bad_models:
        print(f"slotkeeper serve: {line}", file=sys.stderr)
    if bad_models:
        return 2
    node_port = ns.node_port or settings.port + 1
    node_argv = [
        *[a for m in models for a in ("--model", m)],
        *("--slots", ns.slots),
        *("--ctx", ns.ctx),
        *("--host", "127.0.0.1"),
        *("--port", str(node_port)),
        *("--data-dir", str(data)),
        *("--node-id", "local"),
        *("--redis-prefix", settings.redis_prefix),
        *("--s3-prefix", settings.s3_prefix),
        *("--log-level", settings.log_level),
        *("--store-compression", ns.store_compression),
    ]
    if settings.s3_bucket:
        node_argv += ["--s3-bucket", settings.s3_bucket]
        if settings.s3_endpoint:
            node_argv += ["--s3-endpoint", settings.s3_endpoint]
    else:
        # The store is this machine's disk: a spill-cache copy of what it holds would be a second
        # copy of the same bytes, so the cache keeps only files not yet stored (and fills in flight).
        node_argv += ["--spill-bytes", "0"]
    if settings.redis_url:
        node_argv += ["--redis-url", settings.redis_url]
    # The node API and the engines answer only this credential; one machine: a fresh one per start.
    internal_key = settings.internal_key or new_key()
    try:
        node_settings = parse_node_settings(node_argv, {**os.environ, env_name("internal_key"): internal_key})
    except SettingsError as exc:
        print(f"slotkeeper serve: {exc}", file=sys.stderr)
        return 2
    gw_settings = dataclasses.replace(
        settings, nodes=(f"http://127.0.0.1:{node_port}",), internal_key=internal_key
    )
    redis = (
        aioredis.from_url(settings.redis_url, decode_responses=True)
        if settings.redis_url
        else in_process_redis()
    )
    node_server = build_server(node_settings, os.environ, redis)
    metrics = Metrics()
    app = build_app(lambda: services(gw_settings, metrics, redis=redis), metrics, gw_settings.cors_origins)
    gateway_server = _QuietServer(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            lifespan="on",
            log_config=None,
            access_log=False,
            proxy_headers=False,  # nothing reads the client's address: one ASGI layer less per request
            http=header_deadline(settings.header_timeout_s),
            timeout_keep_alive=round(settings.keep_alive_s),
        )
    )
    log.info(
        "serve.start", gateway=f"http://{settings.host}:{settings.port}", node_port=node_port, models=models
    )
    event_loop.run(_run(node_server, gateway_server))
    return 0 if getattr(node_server, "drained_ok", True) else 1

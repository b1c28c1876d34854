"""`slotkeeper gateway`: the stateless gateway process (startup → serve → shutdown).

Settings are built once from flags and SLOTKEEPER_* variables; clients live in the lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import structlog
import uvicorn

from engine_pool.http.credentials import auth_headers
from engine_pool.http.deadlines import header_deadline
from engine_pool.process import logs
from engine_pool.process import loop as event_loop
from engine_pool.process.flags import env_name
from engine_pool.process.startup import EXIT_UNAVAILABLE, StartError, listen_socket, report
from gateway.app import build_app
from gateway.cluster import Cluster
from gateway.healing import IndexHealing
from gateway.metrics import Metrics
from gateway.retention import Retention
from gateway.sealing import ReasoningSeal
from gateway.services import Services
from gateway.settings import GatewaySettings, SettingsError, parse_settings
from gateway.tenants import TenantConfigError, load_tenants
from gateway.turn.engine_call import engine_session
from gateway.turn.parts import TurnParts, TurnSettings
from gateway.turn.runner import TurnRunner
from storage.blobs.blobstore import BlobStore
from storage.blobs.location import open_blob_store
from storage.blobs.stored_responses import ResponseStore
from storage.chunks.chunkstore import ChunkedStore
from storage.chunks.ledger import ChunkLedger
from storage.index.engines import EngineRegistry
from storage.index.epoch import IndexEpoch
from storage.index.locks import SessionLocks
from storage.index.session_index import SessionIndex, in_process_redis
from storage.index.topology import connect
from storage.probe import check_backends

log = structlog.get_logger("slotkeeper.gateway")


def make_store(settings: GatewaySettings, redis: Any) -> ChunkedStore:
    """S3 when a bucket is configured, else a directory under --data-dir; sessions are
    stored in chunks (storage.chunks.chunkstore), shared pieces accounted on `redis`."""
    inner = open_blob_store(settings, Path(settings.data_dir) / "blobs")
    return ChunkedStore(inner, ChunkLedger(redis, prefix=settings.redis_prefix))


@contextlib.asynccontextmanager
async def services(
    settings: GatewaySettings, metrics: Metrics, *, redis: Any = None, store: BlobStore | None = None
) -> AsyncIterator[Services]:
    """Every client the gateway needs; `redis`/`store` may be shared with an in-process node."""
    tenants = load_tenants(settings.tenants)
    own_redis = redis is None
    if redis is None:
        redis = connect(settings.redis_url) if settings.redis_url else in_process_redis()
    own_store = store is None
    store = store or make_store(settings, redis)
    index = SessionIndex(redis, prefix=settings.redis_prefix, routes_per_session=settings.routes_per_session)
    locks = SessionLocks(redis, prefix=settings.redis_prefix)
    registry = EngineRegistry(redis, prefix=settings.redis_prefix)
    await check_backends(store, redis, settings.redis_prefix, "gateway")  # refuse to start if unusable
    # Engines answer only the internal credential; a silent engine fails the request it serves, only.
    http = httpx.AsyncClient(
        timeout=httpx.Timeout(settings.request_timeout_s, connect=5.0),
        headers=auth_headers(settings.internal_key),
    )
    engines = engine_session(auth_headers(settings.internal_key), settings.request_timeout_s)
    # A lost index is noticed and rebuilt from the store (gateway.healing). The in-process index
    # starts empty every time: it is built before the gateway serves.
    cluster = Cluster(registry, index, settings.nodes, http, sample=settings.placement_sample)
    epoch = IndexEpoch(redis, prefix=settings.redis_prefix)
    healing = IndexHealing(
        epoch, store, index, metrics, slots=cluster.labelled_slots, unstored=cluster.unstored_copies
    )
    await healing.start(wait=settings.redis_url is None)
    retention = None
    if isinstance(store, ChunkedStore):
        retention = Retention(store, index, tenants, interval_s=settings.collect_interval_s)
    turn_settings = TurnSettings(
        lock_ttl_s=settings.lock_ttl_s,
        spill_wait_s=settings.spill_wait_s,
        save_grace_s=settings.save_grace_s,
        early_start=settings.early_start,
        handoff=settings.handoff,
        handoff_threshold=settings.handoff_threshold,
        handoff_wait_s=settings.handoff_wait_s,
        handoff_timeout_s=settings.handoff_timeout_s,
        internal_key=settings.internal_key,
        keep_generations=settings.keep_generations,
        max_inflight=settings.max_inflight,
        inflight_ttl_s=settings.request_timeout_s + 60,
    )
    superseded = retention.collect_soon if retention is not None else None
    parts = TurnParts(
        cluster, index, locks, store, metrics, turn_settings, engines, tenants, superseded, healing
    )
    runner = TurnRunner(parts)
    tasks = [asyncio.create_task(healing.watch(), name="index-watch")]
    if retention is not None:
        tasks.append(asyncio.create_task(retention.run(runner.delete), name="retention"))
    try:
        yield Services(
            settings,
            tenants,
            index,
            locks,
            registry,
            store,
            http,
            engines,
            cluster,
            runner,
            metrics,
            ResponseStore(store),
            ReasoningSeal.for_keys(settings.sealing_key, settings.internal_key),
            retention,
        )
    finally:
        for task in tasks:
            await event_loop.cancel_and_wait(task)
        await healing.close()
        await http.aclose()
        await engines.aclose()
        for node in parts.nodes.values():
            await node.aclose()
        if own_store:
            await store.aclose()
        if own_redis:
            await redis.aclose()


def main(argv: list[str]) -> int:
    try:
        settings = parse_settings(argv, os.environ)
        load_tenants(settings.tenants)  # fail fast on a bad tenants file
    except (SettingsError, TenantConfigError) as exc:
        print(f"slotkeeper gateway: {exc}", file=sys.stderr)
        return 2
    # A stateless gateway (several replicas, nodes elsewhere) shares its index and blobs with the
    # nodes: an in-process index or a local directory would silently split the state.
    # `slotkeeper serve` is the one-machine form with embedded defaults.
    required = (
        ("--node", settings.nodes),
        ("--redis-url", settings.redis_url),
        ("--s3-bucket", settings.s3_bucket),
        (env_name("internal_key"), settings.internal_key),
    )
    missing = [flag for flag, value in required if not value]
    if missing:
        print(
            f"slotkeeper gateway: {', '.join(missing)} required (or use `slotkeeper serve`)", file=sys.stderr
        )
        return 2
    logs.configure(settings.log_format, settings.log_level)
    metrics = Metrics()
    app = build_app(lambda: services(settings, metrics), metrics, settings.cors_origins)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        lifespan="on",
        http=header_deadline(settings.header_timeout_s),
        proxy_headers=False,  # nothing reads the client's address: one layer less
        timeout_keep_alive=round(settings.keep_alive_s),
    )
    try:
        sock = listen_socket(settings.host, settings.port, "--port")
    except StartError as err:
        return report("gateway", err, settings.log_format)
    server = uvicorn.Server(config)
    event_loop.run(server.serve(sockets=[sock]))
    return 0 if server.started else EXIT_UNAVAILABLE

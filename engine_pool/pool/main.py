"""`slotkeeper node`: the node agent process — settings, logging, the node's parts, uvicorn, the drain.

Startup reads top to bottom: settings from flags and environment, logging, then uvicorn serves the
node API; its lifespan opens the parts (blob store, spill cache, Redis or the in-process index,
the HTTP client to the engines), starts the agent (one supervised engine per model, the registry
and flush loops) and closes everything on the way out.

SIGTERM or SIGINT starts the drain instead of stopping the server: the API keeps answering
(`/health` says draining, slot operations 503) while every live session is spilled and the
engines are stopped; then the server exits. A second signal stops at once. Exit codes: 0 after a
drain that saved and uploaded every live session (or a stop without a drain), 1 when a spill failed
or an upload is still pending in the spill cache (it is retried at the next start from the same
--data-dir), 2 for bad flags or variables, or a --model that is no readable GGUF file (one line each
on stderr, before anything starts: `model_check`), 3 when it could not start (its port in use, the
index or the store unreachable): `engine_pool.process.startup`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from types import FrameType
from typing import Any

import httpx
import structlog
import uvicorn
from starlette.applications import Starlette

from engine_pool.http import keep_alive
from engine_pool.http.credentials import auth_headers
from engine_pool.process import logs
from engine_pool.process.flags import settings_or_status
from engine_pool.process.signals import SignalServer
from engine_pool.process.startup import EXIT_UNAVAILABLE, StartError, listen_socket, report
from storage.blobs.location import open_blob_store
from storage.blobs.retry import RetryPolicy
from storage.blobs.spillcache import SpillCache
from storage.chunks.chunkstore import ChunkedStore
from storage.chunks.ledger import ChunkLedger
from storage.index.engines import EngineRegistry
from storage.index.session_index import SessionIndex, in_process_redis
from storage.index.topology import connect
from storage.probe import check_backends

from .agent import NodeAgent, NodeParts
from .model_check import check_models
from .routes import build_node_app
from .settings import NodeSettings, build_parser, describe, parse_node_settings

log = structlog.get_logger("engine.node")
# A spill waits for the store at most about a second; after that the flush loop takes over.
UPLOAD_RETRY = RetryPolicy(attempts=3, base_s=0.2, max_s=1.0)


async def open_parts(s: NodeSettings, stack: AsyncExitStack, redis: Any = None) -> NodeParts:
    """The node's clients and stores, each closed by `stack` in reverse order. `redis` shares an
    index client owned by the caller (`slotkeeper serve` runs gateway and node in one process)."""
    await asyncio.to_thread(s.data_path.mkdir, parents=True, exist_ok=True)
    store = open_blob_store(s, s.data_path / "blobs", retry=UPLOAD_RETRY)
    stack.push_async_callback(store.aclose)
    cache = await SpillCache.open(s.data_path / "spill", max_bytes=s.spill_bytes)
    shared = redis is not None
    if redis is None:
        if s.redis_url:
            redis = connect(s.redis_url, decode_responses=True)
        else:
            redis = in_process_redis()
        stack.push_async_callback(redis.aclose)
    store = ChunkedStore(store, ChunkLedger(redis, prefix=s.redis_prefix), compress=s.compresses_states)
    # Misconfiguration is found here, not at the first spill: a bucket S3 refuses, wrong keys, an
    # unreachable Redis stop the start with a precise message (see `check_backends`). With a shared
    # index (serve), the gateway in this process probes the same index and store with the same
    # settings: once is enough.
    if not shared:
        await check_backends(store, redis, s.redis_prefix, "node")
    http = await stack.enter_async_context(
        httpx.AsyncClient(
            timeout=httpx.Timeout(30.0, connect=5.0),
            headers=auth_headers(s.internal_key),
            limits=keep_alive.CLIENT_LIMITS,  # let go before an engine closes
        )
    )
    return NodeParts(
        store=store,
        cache=cache,
        index=SessionIndex(redis, prefix=s.redis_prefix),
        registry=EngineRegistry(redis, prefix=s.redis_prefix),
        http=http,
    )


class NodeServer(SignalServer):
    """uvicorn whose first SIGTERM/SIGINT drains the node; the drain ends the server."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.drain_requested = asyncio.Event()
        self.no_engines = asyncio.Event()  # every engine gave up: `gave_up` says why, by engine
        self.gave_up: dict[str, str] = {}
        self.drained_ok = True
        self._loop: asyncio.AbstractEventLoop | None = None

    def engines_gave_up(self, reasons: dict[str, str]) -> None:
        self.gave_up = dict(reasons)
        self.no_engines.set()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self.drain_requested.is_set():
            super().handle_exit(sig, frame)  # not serving yet, or a second signal: stop now
            return
        log.info("node.signal", signal=signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self.drain_requested.set)

    async def drain_when_asked(self, agent: NodeAgent) -> None:
        self._loop = asyncio.get_running_loop()
        await self.drain_requested.wait()
        self.drained_ok = False
        try:
            self.drained_ok = await agent.drain()
        finally:
            self.should_exit = True


def build_server(settings: NodeSettings, environ: Mapping[str, str], redis: Any = None) -> NodeServer:
    """The node's server; `environ` is the node's environment, from which each engine's is made."""
    holder: dict[str, NodeServer] = {}

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            agent = NodeAgent(
                settings,
                await open_parts(settings, stack, redis),
                settings.engine_specs(environ),
                on_no_engines=holder["server"].engines_gave_up,
            )
            app.state.agent = agent
            stack.push_async_callback(agent.close)
            await agent.start()
            drain = asyncio.create_task(holder["server"].drain_when_asked(agent))
            try:
                yield
            finally:
                drain.cancel()
                await asyncio.gather(drain, return_exceptions=True)

    config = uvicorn.Config(
        build_node_app(lifespan, settings.internal_key),
        host=settings.host,
        port=settings.port,
        lifespan="on",
        log_config=None,
        access_log=False,
        timeout_keep_alive=round(keep_alive.SERVER_S),
        timeout_graceful_shutdown=5,
    )
    holder["server"] = server = NodeServer(config)
    return server


def main(argv: list[str]) -> int:
    settings = settings_or_status("node", argv, lambda: parse_node_settings(argv, os.environ), build_parser)
    if isinstance(settings, int):
        return settings
    bad_models = check_models(settings.models)
    for line in bad_models:
        print(f"slotkeeper node: error: {line}", file=sys.stderr)
    if bad_models:
        return 2
    logs.configure(settings.log_format, settings.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per health probe otherwise
    try:
        sock = listen_socket(settings.host, settings.port, "--port")
    except StartError as err:
        return report("node", err, settings.log_format)
    log.info("node.starting", settings=describe(settings))
    server = build_server(settings, os.environ)
    server.run(sockets=[sock])
    if not server.started:
        log.error("node.exit", code=EXIT_UNAVAILABLE, reason="the server did not start (the error above)")
        return EXIT_UNAVAILABLE
    code = 0 if server.drained_ok else 1
    log.info("node.exit", code=code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

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
import socket
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import structlog
import uvicorn

from engine_pool.http.credentials import new_key
from engine_pool.http.deadlines import header_deadline
from engine_pool.pool.main import NodeServer, build_server
from engine_pool.pool.model_check import check_models
from engine_pool.pool.settings import parse_node_settings
from engine_pool.process import logs
from engine_pool.process import loop as event_loop
from engine_pool.process.flags import add_flags, env_name, parse_bool
from engine_pool.process.startup import EXIT_FAILED, EXIT_USAGE, StartError, listen_socket, report
from engine_pool.protocol.handoff import ROLES
from gateway.app import build_app
from gateway.main import services
from gateway.metrics import Metrics
from gateway.sealing import persisted_key
from gateway.settings import FLAGS, GatewaySettings, SettingsError, settings_from_args
from gateway.tenants import TenantConfigError, load_tenants
from native.model_gen import cached_model
from storage.index.session_index import in_process_redis
from storage.index.topology import connect

log = structlog.get_logger("slotkeeper.serve")


class _QuietServer(uvicorn.Server):
    """The gateway's server: signals belong to the node server, which drains and then ends both; a
    start-up that fails (Redis or the store refused: `storage.probe` printed why) returns instead of
    ending the process from inside a task, so that the node stops its engines and serve says it
    did not start (`_serve`)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().startup(sockets)
        except SystemExit:  # uvicorn's exit after a failed lifespan start
            self.should_exit = True


# A model whose GGUF has no usable chat template is rendered as ChatML (with a warning): these give
# every engine the model's own, as llama-server's flags of the same names.
_TEMPLATE_FLAGS = {
    "--chat-template": "chat template of every model: a built-in name (chatml, llama3, gemma, ...) or "
    "jinja text (default: each GGUF's own)",
    "--chat-template-file": "chat template of every model, from a jinja file (default: each GGUF's own)",
}

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
    for name, what in _TEMPLATE_FLAGS.items():
        variable = env_name(name.removeprefix("--").replace("-", "_"))
        first.add_argument(name, default=environ.get(variable), help=f"{what} [env {variable}]")
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
        "--role",
        action="append",
        choices=ROLES,
        help="role of the Nth --model's engine in a prefill/decode split: prefill, decode or mixed "
        "(default mixed); give a model twice for a prefill and a decode engine of it "
        f"[env {env_name('roles')}, comma-separated]",
    )
    rest.add_argument(
        "--keep-running",
        action="store_const",
        const="on",
        default=environ.get(env_name("keep_running"), "off"),
        help="stay up when every engine has given up (default: exit with status 1, saying why) "
        f"[env {env_name('keep_running')}]",
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
    ap.set_defaults(
        env_models=[m for m in environ.get(env_name("models"), "").split(",") if m],
        env_roles=[r for r in environ.get(env_name("roles"), "").split(",") if r],
    )
    return ap


async def _stop_when_no_engines(node_server: NodeServer) -> None:
    """One machine whose every engine gave up serves nothing: end serve (its status says so)."""
    await node_server.no_engines.wait()
    node_server.should_exit = True


async def _run(
    node_server: NodeServer, gateway_server: uvicorn.Server, sockets: _Sockets, keep_running: bool
) -> None:
    gateway = asyncio.create_task(gateway_server.serve(sockets=[sockets.gateway]))
    # A gateway that ended (its start failed) ends the node too: serve without it serves nothing.
    gateway.add_done_callback(lambda _: setattr(node_server, "should_exit", True))
    watch = None if keep_running else asyncio.create_task(_stop_when_no_engines(node_server))
    try:
        await node_server.serve(sockets=[sockets.node])  # returns after a drain, a give-up or a failed start
    finally:
        gateway_server.should_exit = True
        await gateway
        if watch is not None:
            await event_loop.cancel_and_wait(watch)


@dataclasses.dataclass(frozen=True)
class _Sockets:
    """The two listening sockets, bound before anything starts: a port in use ends the start at once."""

    gateway: socket.socket
    node: socket.socket


def _no_engines_error(node_server: NodeServer) -> StartError:
    reasons = "; ".join(f"{engine}: {why}" for engine, why in node_server.gave_up.items())
    return StartError(
        f"no engine is left, every one gave up: {reasons}",
        "fix what the engine says (the model file, an engine argument) and start serve again; "
        "--keep-running keeps serve up without engines",
        EXIT_FAILED,
    )


def main(argv: list[str]) -> int:
    ns = _parser(os.environ).parse_args(argv)
    try:
        settings = settings_from_args(vars(ns), os.environ)
        load_tenants(settings.tenants)
    except (SettingsError, TenantConfigError) as exc:
        usage = StartError(str(exc), "see `slotkeeper serve --help`", EXIT_USAGE)
        return report("serve", usage, ns.log_format or "auto")
    logs.configure(settings.log_format, settings.log_level)
    try:
        return _serve(ns, settings)
    except StartError as err:
        return report("serve", err, settings.log_format)


def _models(ns: argparse.Namespace, data: Path) -> list[str]:
    """The models to serve, each a GGUF file: those named, else the tiny demo model (said loudly)."""
    models: list[str] = ns.model or ns.env_models
    if not models:
        try:
            models = [cached_model(data / "models", "qwen35", size="tiny")]
        except OSError as exc:
            raise StartError(
                f"cannot write the demo model under {data}: {exc.strerror or exc}",
                "pass --data-dir with a directory you can write, or --model with a GGUF file",
            ) from None
        warning = "no --model given: serving a TINY RANDOM-WEIGHT qwen35 that answers gibberish"
        log.warning("serve.demo_model", model=models[0], warning=warning)
        print(f"WARNING: {warning} ({models[0]})", file=sys.stderr)
    bad_models = check_models(models)
    if bad_models:
        hint = "pass --model with the path of a GGUF file (llama.cpp's format)"
        raise StartError("; ".join(bad_models), hint, EXIT_USAGE)
    return models


def _node_argv(
    ns: argparse.Namespace, settings: GatewaySettings, models: list[str], node_port: int, data: Path
) -> list[str]:
    """The node agent's command line, from serve's own flags and settings."""
    node_argv = [
        *[a for m in models for a in ("--model", m)],
        *[a for r in ns.role or ns.env_roles for a in ("--role", r)],
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
    for name in _TEMPLATE_FLAGS:
        value = getattr(ns, name.removeprefix("--").replace("-", "_"))
        if value:
            node_argv += [f"--engine-arg={name}", f"--engine-arg={value}"]
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
    return node_argv


def _serve(ns: argparse.Namespace, settings: GatewaySettings) -> int:
    data = Path(settings.data_dir)
    node_port = ns.node_port or settings.port + 1
    try:
        keep_running = parse_bool(ns.keep_running)
    except ValueError as exc:
        raise StartError(f"{env_name('keep_running')}: {exc}", "set it to on or off", EXIT_USAGE) from None
    sockets = _Sockets(
        listen_socket(settings.host, settings.port, "--port"),
        listen_socket("127.0.0.1", node_port, "--node-port"),
    )
    models = _models(ns, data)
    node_argv = _node_argv(ns, settings, models, node_port, data)
    # The node API and the engines answer only this credential; one machine: a fresh one per start.
    internal_key = settings.internal_key or new_key()
    try:
        node_settings = parse_node_settings(node_argv, {**os.environ, env_name("internal_key"): internal_key})
    except SettingsError as exc:
        raise StartError(str(exc), "see `slotkeeper serve --help`", EXIT_USAGE) from None
    # Reasoning sealed for store:false clients must open after a restart too: a key kept in --data-dir.
    sealing_key = settings.sealing_key or persisted_key(data)
    gw_settings = dataclasses.replace(
        settings, nodes=(f"http://127.0.0.1:{node_port}",), internal_key=internal_key, sealing_key=sealing_key
    )
    redis = connect(settings.redis_url, decode_responses=True) if settings.redis_url else in_process_redis()
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
    event_loop.run(_run(node_server, gateway_server, sockets, keep_running))
    if node_server.no_engines.is_set() and not keep_running:
        raise _no_engines_error(node_server)
    if not (node_server.started and gateway_server.started):
        raise StartError(
            "serve did not start (the error above says why)",
            "--log-level debug shows the whole traceback",
        )
    return 0 if node_server.drained_ok else EXIT_FAILED

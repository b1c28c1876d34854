"""`slotkeeper_gateway_requests_in_flight`: what the chart's HPA can scale on.

Read where Prometheus reads it, on `/metrics` of a server on a loopback port: the `RequestCounter`
middleware around a tiny Starlette app whose streams the test holds open, ends, breaks and abandons;
then the real gateway app (`build_app` with its own services: in-process index, local store, no
engines), whose probes and scrapes must not count as load.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gateway.app import build_app
from gateway.bench.harness.servers import INTERNAL_KEY, free_port
from gateway.main import services
from gateway.metrics import NOT_LOAD, Metrics, RequestCounter
from gateway.settings import GatewaySettings

IN_FLIGHT = "slotkeeper_gateway_requests_in_flight"


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text → {(sample name, sorted labels): value}."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def in_flight(client: httpx.AsyncClient) -> float:
    r = await client.get("/metrics")
    assert r.status_code == 200
    return scrape(r.text)[(IN_FLIGHT, ())]


async def eventually(probe: Callable[[], Awaitable[bool]], what: str, within_s: float = 10.0) -> None:
    """Wait for `probe` with a deadline that fails loudly (the server finishes a response after the
    client has read its last byte, so the gauge falls a moment later)."""
    try:
        async with asyncio.timeout(within_s):
            while True:  # polled: the server updates the gauge after the client has its bytes
                if await probe():
                    return
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"not {what} after {within_s}s") from None


@contextlib.asynccontextmanager
async def serving(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    """`app` under uvicorn on a free loopback port in this event loop; a client for it."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            await eventually(lambda: _started(server, task), "serving")
            yield client
    finally:
        server.should_exit = True
        await task


async def _started(server: uvicorn.Server, task: asyncio.Task[None]) -> bool:
    if task.done():
        task.result()  # a server that could not start raises here
    return server.started


class Streams:
    """A tiny app: `/stream` sends a chunk every 20 ms until `release` is set (a client that goes
    away is noticed at the next send, as the gateway's relay notices it at the engine's next chunk),
    `/stream-fails` raises after its first chunk, `/fails` before any response."""

    def __init__(self) -> None:
        self.metrics = Metrics()
        self.release = asyncio.Event()
        routes = [
            Route("/stream", self.stream),
            Route("/stream-fails", self.stream_fails),
            Route("/fails", self.fails),
            Route("/metrics", self.scrape),
        ]
        self.app = Starlette(
            routes=routes, middleware=[Middleware(RequestCounter, metrics=self.metrics, routes=routes)]
        )

    async def stream(self, request: Request) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            yield b"first\n"
            while not self.release.is_set():
                await asyncio.sleep(0.02)
                yield b".\n"
            yield b"last\n"

        return StreamingResponse(chunks(), media_type="text/plain")

    async def stream_fails(self, request: Request) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            yield b"first\n"
            raise RuntimeError("the engine went away mid-stream")

        return StreamingResponse(chunks(), media_type="text/plain")

    async def fails(self, request: Request) -> Response:
        raise RuntimeError("a bug before the response started")

    async def scrape(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def rest(chunks: AsyncIterator[bytes]) -> bytes:
    return b"".join([chunk async for chunk in chunks])


async def is_zero(client: httpx.AsyncClient) -> bool:
    return await in_flight(client) == 0


async def test_a_stream_is_in_flight_until_its_last_chunk() -> None:
    streams = Streams()
    async with serving(streams.app) as client:
        assert await in_flight(client) == 0  # the scrape does not count itself
        async with client.stream("GET", "/stream") as r:
            body = r.aiter_bytes()
            assert (await anext(body)).startswith(b"first")
            assert await in_flight(client) == 1
            async with client.stream("GET", "/stream") as second:
                more = second.aiter_bytes()
                assert (await anext(more)).startswith(b"first")
                assert await in_flight(client) == 2
                streams.release.set()
                assert (await rest(more)).endswith(b"last\n")
            assert (await rest(body)).endswith(b"last\n")
        await eventually(lambda: is_zero(client), "back to 0 after both streams ended")
        counted = scrape((await client.get("/metrics")).text)
        assert counted[("slotkeeper_gateway_requests_total", (("path", "/stream"), ("status", "200")))] == 2


async def test_a_client_that_goes_away_leaves_the_count() -> None:
    streams = Streams()
    async with serving(streams.app) as client:
        async with httpx.AsyncClient(base_url=client.base_url) as leaving:
            async with leaving.stream("GET", "/stream") as r:
                assert (await anext(r.aiter_bytes())).startswith(b"first")
                assert await in_flight(client) == 1
        # closed before the end: the connection is dropped, the stream never released
        await eventually(lambda: is_zero(client), "back to 0 after the client disconnected")
        assert not streams.release.is_set()


@pytest.mark.parametrize("path", ["/fails", "/stream-fails"])
async def test_a_request_that_raises_leaves_the_count(path: str) -> None:
    streams = Streams()
    async with serving(streams.app) as client:
        async with httpx.AsyncClient(base_url=client.base_url) as failing:
            try:
                r = await failing.get(path)
                assert r.status_code == 500  # before the response: Starlette's error response
            except httpx.RemoteProtocolError:
                assert path == "/stream-fails"  # after it started: the connection is cut
        await eventually(lambda: is_zero(client), f"back to 0 after {path} raised")


async def test_the_gateway_counts_requests_but_not_probes_or_scrapes(tmp_path: Path) -> None:
    """The real app: a chat with no engine registered is refused (an error rendered by the app's
    handler) and leaves the count; `/health`, `/ready` and `/metrics` — every route in NOT_LOAD is
    one of the app's — are never load."""
    settings = GatewaySettings(data_dir=str(tmp_path), internal_key=INTERNAL_KEY)
    metrics = Metrics()
    app = build_app(lambda: services(settings, metrics), metrics)
    assert NOT_LOAD <= {getattr(route, "path", None) for route in app.routes}
    async with serving(app) as client:
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/ready")).status_code == 503  # no engines
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        refused = await client.post("/v1/chat/completions", json=body)
        assert refused.status_code >= 400 and "error" in refused.json()
        await eventually(lambda: is_zero(client), "back to 0 after the refused chat")
        samples = scrape((await client.get("/metrics")).text)
        chat = (("path", "/v1/chat/completions"), ("status", str(refused.status_code)))
        assert samples[("slotkeeper_gateway_requests_total", chat)] == 1

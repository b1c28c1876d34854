"""What every route module of the engine reads from a request, and how it names its paths.

The runtime and the request limits live in the app's state (`app.build_app` puts them there once);
a route reads them through these functions, never through another route module. `aliased` builds
llama-server's double names for one endpoint. Nothing here is a route: the route modules
(`routes_llama`, `routes_openai`, `apis.routes`, `apis.vertex`, `cors_proxy`) are the edges, and
only `app` imports them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine_pool.http.body import Body, read_json

from .limits import RequestLimits
from .runtime import Runtime

Endpoint = Callable[[Request], Awaitable[Response]]


def runtime(request: Request) -> Runtime:
    rt: Runtime = request.app.state.runtime
    return rt


def limits(request: Request) -> RequestLimits:
    """The engine's request limits, built once from its settings by `app.build_app`."""
    lim: RequestLimits = request.app.state.limits
    return lim


async def limits_and_body(request: Request) -> tuple[RequestLimits, Body]:
    """The engine's request limits and the request's JSON body, read within them."""
    lim = limits(request)
    return lim, await read_json(request, lim.body)


def aliased(endpoint: Endpoint, methods: list[str], *paths: str) -> list[Route]:
    """`endpoint` at each of `paths`: llama-server answers much of its API under two names (`/health`
    and `/v1/health`, `/completion` and `/completions`)."""
    return [Route(path, endpoint, methods=methods) for path in paths]

"""The internal credential: what node agents and engines demand of every caller but their health probes.

Tenants only ever talk to the gateway; inside the cluster, the node agent API (spill, fill, erase,
forget, engine listings) and the engines' llama-server API answer only callers presenting the
shared secret the gateway holds (`SLOTKEEPER_INTERNAL_KEY`, a Kubernetes Secret; `slotkeeper serve`
makes a fresh one at every start). The key travels as `Authorization: Bearer KEY` (llama-server's
`--api-key` convention, so an engine is configured with it as its API key) and is compared in
constant time. Health probes stay open and say nothing a tenant sent.

Browsers are the other callers at the edge (gateway and engine alike): a page on another origin
first sends a CORS preflight, which carries no key, so CORS is answered outside the key check
(`engine_pool.http.cors`, the outermost middleware).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping

from starlette.types import ASGIApp, Receive, Scope, Send

from engine_pool.errors import Unauthorized, render_error
from engine_pool.process.flags import ENV_PREFIX, env_name

# Variables a node must never hand to the engines it spawns: its own settings (an engine reads
# SLOTKEEPER_* as its own flags) and its store's credentials (an engine has no business with S3).
_NOT_FOR_ENGINES = (ENV_PREFIX, "AWS_")


def new_key() -> str:
    """A fresh internal key (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def presented(headers: Mapping[str, str]) -> str:
    """The key a request presents: `Authorization: Bearer KEY`, else `X-Api-Key` (lower-case names)."""
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return headers.get("x-api-key", "")


def matches(given: str, key: str) -> bool:
    return secrets.compare_digest(given.encode(), key.encode())


def auth_headers(key: str | None) -> dict[str, str]:
    """The headers that present `key` (none when there is no key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def engine_environment(environ: Mapping[str, str], key: str | None) -> dict[str, str]:
    """The environment of a spawned engine: the node's, less its settings and store secrets, plus the
    engine's API key (a variable, not an argument: arguments show in `ps`)."""
    env = {k: v for k, v in environ.items() if not k.startswith(_NOT_FOR_ENGINES)}
    if key:
        env[env_name("api_key")] = key
    return env


class RequireKey:
    """ASGI middleware: 401 for any HTTP request outside `public` that does not present `key`."""

    def __init__(self, app: ASGIApp, key: str, public: frozenset[str]) -> None:
        self.app = app
        self.key = key
        self.public = public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.public:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            if not matches(presented(headers), self.key):
                err = Unauthorized("this endpoint requires the internal credential (Authorization: Bearer)")
                await render_error(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)

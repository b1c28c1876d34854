"""The async client the gateway uses for one node agent's API (`engine_pool.pool.agent`); the
requests and results are the node API's models (`engine_pool.protocol.node`), shared with the agent.

Every failure is a `NodeError` carrying the HTTP status and the node's error `type` and
`message` (from its `{"error": {...}}` body); a node that cannot be reached is status 502,
type `node_unreachable`.

Retries: one, and only when the failure came before the first byte of the response (the request
is sent with `stream=True`, so only a failure to connect, send or read the status line is caught
there). The retry runs on a new connection of its own, never on a pooled one that may be the
broken one (llama-server users saw stale keep-alive connections after streamed responses). Spill
is not idempotent (a second save of the same generation is a conflict), so it is retried only
when the request surely never left (connect errors); the others are retried on any such failure.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Self

import httpx

from ..common.credentials import auth_headers
from ..common.errors import ApiError
from ..protocol.node import (
    ENGINES,
    HEALTH,
    CancelResult,
    EngineList,
    EraseResult,
    FillRequest,
    FillResult,
    ForgetResult,
    NodeEngine,
    NodeHealth,
    SpillRequest,
    SpillResult,
    session_path,
    slot_path,
)

_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
_NO_RESPONSE = (*_NOT_SENT, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.ReadTimeout)


class NodeError(ApiError):
    """The node answered with an error (or could not be reached): its status, type, code and message."""

    def __init__(
        self,
        status: int,
        type: str,
        message: str,
        *,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message, status=status, type=type, code=code, retry_after=retry_after)

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"


class NodeClient:
    """One node agent at `base_url` (e.g. ``http://10.0.0.5:8070``)."""

    def __init__(
        self,
        base_url: str,
        *,
        key: str | None = None,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self._headers = auth_headers(key)  # the internal credential (engine_pool.common.credentials)
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=self._timeout, headers=self._headers)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # -- the API -------------------------------------------------------------------------------------
    async def health(self) -> NodeHealth:
        """Status "ok" or "draining" (a draining node answers 503 with the same body)."""
        r = await self._send("GET", HEALTH, retry_on=_NO_RESPONSE)
        body = _json(r)
        if r.status_code in (200, 503) and isinstance(body, dict) and "status" in body:
            return NodeHealth.from_json(body)
        raise _error(r, body)

    async def engines(self) -> list[NodeEngine]:
        body = await self._call("GET", ENGINES, retry_on=_NO_RESPONSE)
        return list(EngineList.from_json(body).engines)

    async def spill(
        self,
        engine: str,
        slot: int,
        *,
        tenant: str,
        session: str,
        generation: int,
        route: str = "",
        share: bool = True,
    ) -> SpillResult:
        """Save the slot as (tenant, session, generation) and upload it; see `SpillResult.uploaded`.
        `route` is the session's newest routing digest, kept with the object for reindexing;
        `share` lets its stored chunks be shared with the tenant's other sessions."""
        body = SpillRequest(tenant, session, generation, route, share).to_json()
        out = await self._call("POST", slot_path(engine, slot, "spill"), body, retry_on=_NOT_SENT)
        return SpillResult.from_json(out)

    async def fill(
        self,
        engine: str,
        slot: int,
        *,
        tenant: str,
        session: str,
        generation: int,
        tokens: list[int] | None = None,
        prefix: bool = False,
    ) -> FillResult:
        """Restore (tenant, session, generation) into the slot, from the node's cache or the store.
        ``tokens``: the prompt the slot is restored for; when it leaves the generation early, only
        the part up to the checkpoint it continues from is restored (`FillResult.source` "cut").
        ``prefix``: the generation is another session's, whose prefix the prompt may start from:
        nothing is restored (source "none") when the prompt shares too little of it."""
        body = FillRequest(tenant, session, generation, tokens, prefix).to_json()
        out = await self._call("POST", slot_path(engine, slot, "fill"), body, retry_on=_NO_RESPONSE)
        return FillResult.from_json(out)

    async def forget(self, tenant: str, session: str) -> int:
        """Drop every spill-cache file of the session on this node (pending uploads too)."""
        out = await self._call("DELETE", session_path(tenant, session), retry_on=_NO_RESPONSE)
        return ForgetResult.from_json(out).n_files

    async def cancel(self, engine: str, slot: int) -> bool:
        """End the generation running on the slot; False when none ran there."""
        out = await self._call("POST", slot_path(engine, slot, "cancel"), retry_on=_NO_RESPONSE)
        return CancelResult.from_json(out).cancelled

    async def erase(self, engine: str, slot: int) -> int:
        """Empty the slot; returns the number of tokens it held."""
        out = await self._call("POST", slot_path(engine, slot, "erase"), retry_on=_NO_RESPONSE)
        return EraseResult.from_json(out).n_erased

    # -- plumbing -----------------------------------------------------------------------------------
    async def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        retry_on: tuple[type[Exception], ...],
    ) -> dict[str, Any]:
        r = await self._send(method, path, body, retry_on=retry_on)
        data = _json(r)
        if r.status_code != 200 or not isinstance(data, dict):
            raise _error(r, data)
        return data

    async def _send(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        retry_on: tuple[type[Exception], ...],
    ) -> httpx.Response:
        try:
            return await self._once(self._http, method, path, body)
        except retry_on:
            pass  # nothing of the response arrived: once more, on a connection of its own
        except httpx.HTTPError as exc:
            raise _unreachable(method, path, exc) from exc
        async with httpx.AsyncClient(
            base_url=self.base_url, timeout=self._timeout, headers=self._headers
        ) as fresh:
            try:
                return await self._once(fresh, method, path, body)
            except httpx.HTTPError as exc:
                raise _unreachable(method, path, exc) from exc

    @staticmethod
    async def _once(
        http: httpx.AsyncClient, method: str, path: str, body: dict[str, Any] | None
    ) -> httpx.Response:
        request = http.build_request(method, path, json=body)
        response = await http.send(request, stream=True)  # returns once the status line and headers are in
        try:
            await response.aread()
        except httpx.HTTPError:
            await response.aclose()
            raise _unreachable(method, path, httpx.ReadError("the response broke off")) from None
        return response


def _json(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return None


def _error(r: httpx.Response, body: Any) -> NodeError:
    err = body.get("error") if isinstance(body, dict) else None
    retry = r.headers.get("retry-after")
    retry_after = float(retry) if retry and retry.replace(".", "", 1).isdigit() else None
    if isinstance(err, dict):
        code = err.get("code")
        return NodeError(
            r.status_code,
            str(err.get("type", "error")),
            str(err.get("message", "")),
            code=code if isinstance(code, str) else None,
            retry_after=retry_after,
        )
    return NodeError(r.status_code, "http_error", r.text[:500] or r.reason_phrase, retry_after=retry_after)


def _unreachable(method: str, path: str, exc: Exception) -> NodeError:
    return NodeError(
        502, "node_unreachable", f"{method} {path}: {type(exc).__name__}: {exc}", code="node_unreachable"
    )

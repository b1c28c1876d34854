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

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import Any, Self, cast

import httpx

from engine_pool.errors import ApiError
from engine_pool.http import keep_alive
from engine_pool.http.answers import answer_json, error_object
from engine_pool.http.credentials import auth_headers

from ..protocol import node
from ..protocol.handoff import HANDOFF_MEDIA, HandoffRequest, HandoffResult, Prefilled, prefill_path

_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
_NO_RESPONSE = (*_NOT_SENT, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.ReadTimeout)


class NodeError(ApiError):
    """The node answered with an error (or could not be reached): its status, type, code and message."""

    code = None  # the node's, when it named one

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
        self._headers = auth_headers(key)  # the internal credential (engine_pool.http.credentials)
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=self._timeout,
            headers=self._headers,
            limits=keep_alive.CLIENT_LIMITS,  # let go before the agent closes
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # -- the API -------------------------------------------------------------------------------------
    async def health(self) -> node.NodeHealth:
        """Status "ok" or "draining" (a draining node answers 503 with the same body)."""
        body = await self._call("GET", node.HEALTH, retry_on=_NO_RESPONSE, ok=(200, 503), keys=("status",))
        return node.NodeHealth.from_json(body)

    async def engines(self) -> list[node.NodeEngine]:
        body = await self._call("GET", node.ENGINES, retry_on=_NO_RESPONSE)
        return list(node.EngineList.from_json(body).engines)

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
        fenced: bool = False,
    ) -> node.SpillResult:
        """Save the slot as (tenant, session, generation) and upload it; see `SpillResult.uploaded`.
        `route` is the session's newest routing digest, kept with the object for reindexing;
        `share` lets its stored chunks be shared with the tenant's other sessions; `fenced`: only
        when the slot holds the session (its label), else 409 slot_changed."""
        body = node.SpillRequest(tenant, session, generation, route, share, fenced).to_json()
        out = await self._call("POST", node.slot_path(engine, slot, "spill"), body, retry_on=_NOT_SENT)
        return node.SpillResult.from_json(out)

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
        progress: Callable[[node.FillProgress], None] | None = None,
    ) -> node.FillResult:
        """Restore (tenant, session, generation) into the slot, from the node's cache or the store.
        ``tokens``: the prompt the slot is restored for; when it leaves the generation early, only
        the part up to the checkpoint it continues from is restored (`FillResult.source` "cut").
        ``prefix``: the generation is another session's, whose prefix the prompt may start from:
        nothing is restored (source "none") when the prompt shares too little of it.
        ``progress`` is called with each of the node's `FillProgress` reports as the fill goes."""
        body = node.FillRequest(tenant, session, generation, tokens, prefix, progress is not None).to_json()
        path = node.slot_path(engine, slot, "fill")
        if progress is None:
            return node.FillResult.from_json(await self._call("POST", path, body, retry_on=_NO_RESPONSE))
        return node.FillResult.from_json(await self._reported(path, body, progress))

    async def handoff(self, engine: str, slot: int, request: HandoffRequest) -> HandoffResult:
        """Prefill ``request.body`` on a prefill engine of this node and install the state in the
        slot (engine_pool.pool.handoff). Retried only when it surely never left: a prefill is work."""
        out = await self._call(
            "POST", node.slot_path(engine, slot, "handoff"), request.to_json(), retry_on=_NOT_SENT
        )
        return HandoffResult.from_json(out)

    async def prefill_to_store(self, engine: str, request: HandoffRequest) -> Prefilled:
        """Prefill ``request.body`` on this node's prefill engine ``engine`` and export its state to
        the store object ``request.to_store`` (a handoff through the store,
        engine_pool.pool.handoff_store). Retried only when it surely never left."""
        frame = json.dumps(request.to_json(), separators=(",", ":")).encode() + b"\n"
        out = await self._call("POST", prefill_path(engine), frame=frame, retry_on=_NOT_SENT)
        return Prefilled.from_json(out)

    async def forget(self, tenant: str, session: str) -> int:
        """Drop every spill-cache file of the session on this node (pending uploads too)."""
        out = await self._call("DELETE", node.session_path(tenant, session), retry_on=_NO_RESPONSE)
        return node.ForgetResult.from_json(out).n_files

    async def cancel(self, engine: str, slot: int) -> bool:
        """End the generation running on the slot; False when none ran there."""
        out = await self._call("POST", node.slot_path(engine, slot, "cancel"), retry_on=_NO_RESPONSE)
        return node.CancelResult.from_json(out).cancelled

    async def erase(self, engine: str, slot: int) -> int:
        """Empty the slot; returns the number of tokens it held."""
        out = await self._call("POST", node.slot_path(engine, slot, "erase"), retry_on=_NO_RESPONSE)
        return node.EraseResult.from_json(out).n_erased

    # -- plumbing -----------------------------------------------------------------------------------
    async def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        retry_on: tuple[type[Exception], ...],
        ok: tuple[int, ...] = (200,),
        keys: tuple[str, ...] = (),
        frame: bytes | None = None,
    ) -> dict[str, Any]:
        """The JSON object the node answered with a status in ``ok`` and holding ``keys``; any
        other answer is its `NodeError`. Retried once on ``retry_on`` (see the module doc).
        ``frame``: the body is this handoff frame (engine_pool.protocol.handoff), not ``body``."""
        return _checked(await self._answer(method, path, body, retry_on, frame), ok, keys)

    async def _reported(
        self, path: str, body: dict[str, Any], progress: Callable[[node.FillProgress], None]
    ) -> dict[str, Any]:
        """A fill's answer where it reports its progress (`node.FILL_LINES`): each report passed to
        ``progress``, the result's JSON returned, the node's failure (its last line) raised as the
        error it would have answered. An answer that is not lines is read as `_call` reads one."""
        async with self._answer_stream("POST", path, body, _NO_RESPONSE) as r:
            media = r.headers.get("content-type", "").split(";")[0].strip().lower()
            if media != node.FILL_LINES:
                await _read(r, "POST", path)
                return _checked(r)
            try:
                async for line in r.aiter_lines():
                    if not line.strip():
                        continue
                    item = json.loads(line)
                    if not isinstance(item, dict):
                        raise ValueError("a line that is not an object")
                    if "progress" in item:
                        progress(node.FillProgress.from_json(item["progress"]))
                    elif "result" in item:
                        return cast(dict[str, Any], item["result"])
                    else:
                        raise _failed(item)
            except httpx.HTTPError:
                pass
            except ValueError as exc:  # (a WireError too)
                raise NodeError(
                    f"POST {path}: a broken answer: {exc}", status=502, type="bad_node_answer"
                ) from None
        raise _unreachable("POST", path, httpx.ReadError("the response broke off before its result"))

    async def _answer(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        retry_on: tuple[type[Exception], ...],
        frame: bytes | None = None,
    ) -> httpx.Response:
        """The node's whole response (see `_answer_stream`)."""
        async with self._answer_stream(method, path, body, retry_on, frame) as r:
            await _read(r, method, path)
        return r

    @contextlib.asynccontextmanager
    async def _answer_stream(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        retry_on: tuple[type[Exception], ...],
        frame: bytes | None = None,
    ) -> AsyncIterator[httpx.Response]:
        """The node's response with its status line and headers in, its body read in the block
        (closed after it). Retried once on ``retry_on`` (see the module doc)."""
        async with contextlib.AsyncExitStack() as stack:
            try:
                r = await self._send(self._http, method, path, body, frame)
            except retry_on:  # nothing of the response arrived: once more, on a connection of its own
                fresh = httpx.AsyncClient(
                    base_url=self.base_url, timeout=self._timeout, headers=self._headers
                )
                await stack.enter_async_context(fresh)
                try:
                    r = await self._send(fresh, method, path, body, frame)
                except httpx.HTTPError as exc:
                    raise _unreachable(method, path, exc) from exc
            except httpx.HTTPError as exc:
                raise _unreachable(method, path, exc) from exc
            stack.push_async_callback(r.aclose)
            yield r

    @staticmethod
    async def _send(
        http: httpx.AsyncClient, method: str, path: str, body: dict[str, Any] | None, frame: bytes | None
    ) -> httpx.Response:
        if frame is not None:
            request = http.build_request(method, path, content=frame, headers={"content-type": HANDOFF_MEDIA})
        else:
            request = http.build_request(method, path, json=body)
        return await http.send(request, stream=True)  # returns once the status line and headers are in


def _checked(r: httpx.Response, ok: tuple[int, ...] = (200,), keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """The JSON object of a read answer with a status in ``ok`` and holding ``keys``; any other
    answer is its `NodeError`."""
    data = answer_json(r)
    if r.status_code not in ok or not isinstance(data, dict) or not all(k in data for k in keys):
        raise _error(r, data)
    return data


async def _read(response: httpx.Response, method: str, path: str) -> None:
    """The rest of ``response``'s body; a body that breaks off is the node's failure (502)."""
    try:
        await response.aread()
    except httpx.HTTPError:
        raise _unreachable(method, path, httpx.ReadError("the response broke off")) from None


def _failed(item: dict[str, Any]) -> NodeError:
    """The failure a fill's last line reports (`node.FILL_LINES`), as the error it would have answered."""
    status = item.get("status")
    if type(status) is not int or not 400 <= status <= 599:
        raise ValueError(f"a line that is neither a report, a result nor a failure: {sorted(item)}")
    retry = item.get("retry_after")
    headers = (
        {"retry-after": str(retry)} if isinstance(retry, int | float) and not isinstance(retry, bool) else {}
    )
    return _error(httpx.Response(status, headers=headers), item)


def _error(r: httpx.Response, body: Any) -> NodeError:
    err = error_object(body)
    retry = r.headers.get("retry-after")
    retry_after = float(retry) if retry and retry.replace(".", "", 1).isdigit() else None
    if err is not None:
        code = err.get("code")
        return NodeError(
            str(err.get("message", "")),
            status=r.status_code,
            type=str(err.get("type", "error")),
            code=code if isinstance(code, str) else None,
            retry_after=retry_after,
            extra={k: v for k, v in err.items() if k not in ("message", "type", "code", "param")},
        )
    text = r.text[:500] or r.reason_phrase
    return NodeError(text, status=r.status_code, type="http_error", retry_after=retry_after)


def _unreachable(method: str, path: str, exc: Exception) -> NodeError:
    what = f"{method} {path}: {type(exc).__name__}: {exc}"
    return NodeError(what, status=502, type="node_unreachable", code="node_unreachable")

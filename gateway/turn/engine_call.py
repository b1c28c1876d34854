"""Forwarding one request to an engine and relaying its answer without buffering.

Streams pass through byte for byte; on the way, the SSE events are read to learn what the
assistant said (content and tool calls of the first choice, for implicit routing) and the final
usage and timings (llama-server's numbers; the engine's `slotkeeper` reuse facts pass through). An
engine failure before the first byte becomes a 503 with Retry-After (the caller may retry); after
the first byte it becomes an error event in the stream, never a hang.

The client is `gateway.engine_http` (`engine_session`, one per gateway, keep-alive): on the request
path it costs a fraction of a general-purpose client's CPU per request, which the gateway's added
latency is mostly made of (figures: docs/benchmarks.md).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict

from engine_pool.errors import (
    ApiError,
    GatewayTimeout,
    Unavailable,
    Upstream,
    error_payload,
    for_status,
    slot_changed,
)
from engine_pool.protocol.engine_answers import FunctionDelta
from gateway import engine_http
from gateway.engine_http import EngineHttp, EngineHttpError, EngineResponse

CHAT_PATH = "/v1/chat/completions"  # the engine's chat completions path


_BROKE = "the engine stream broke off; retry (the session resumes from its last save)"


@dataclass
class TurnOutcome:
    """What the engine answered, for the session bookkeeping after the turn.

    `tool_calls`, `usage`, `timings` and `report` are the engine's JSON as it came (an engine of
    ours sends `engine_answers.Usage`, `Timings` and `report.ReuseReport`; read here, a type would
    be no check: their readers take what they need and go without what is not there)."""

    ok: bool = False
    content: str = ""
    tool_calls: list[Mapping[str, Any]] = field(default_factory=list)  # the first choice's
    usage: Mapping[str, Any] = field(default_factory=dict)
    timings: Mapping[str, Any] = field(default_factory=dict)  # numbers only (prompt_n, cache_n, ...)
    report: Mapping[str, Any] = field(default_factory=dict)  # the engine's `slotkeeper` (how it reused)
    error: str = ""
    body: bytes = b""  # a non-streamed answer's bytes as the engine sent them
    moved: bool = False  # refused: the slot holds another session's state (engine SlotChanged)
    refused: bool = False  # the engine refused the request before running it (a 4xx, not `moved`)

    def assistant_message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg

    @property
    def tokens(self) -> int:
        return int(self.usage.get("prompt_tokens", 0)) + int(self.usage.get("completion_tokens", 0))


def refused_unrun(exc: BaseException) -> bool:
    """Whether an engine's error says it refused the request before running it: a 4xx (the body,
    a limit, its admission), not a slot that holds another session's state (`slot_changed`)."""
    return isinstance(exc, ApiError) and 400 <= exc.status < 500 and not slot_changed(exc)


_WS = b" \t\r\n"  # JSON's whitespace


def engine_body(raw: bytes | None, body: Mapping[str, Any], fields: Mapping[str, Any]) -> bytes:
    """The bytes to send an engine: the tenant's JSON object ``raw`` (``body`` parsed from it) with
    ``fields`` set, a field set to None dropped. Not encoded again: the fields are appended after
    the tenant's members, which a parser that keeps the last of duplicate names (Python's, the
    engine's) reads as ``{**body, **fields}``: encoding grows with the history while appending does
    not, so a long agent history costs no more per turn than a short one (figures:
    docs/benchmarks.md). A field dropped is appended as null, which the engine reads as absent.
    Bodies that are not plain UTF-8 (a BOM, UTF-16: Python's parser accepts them) or absent are
    encoded from ``body``."""
    if raw is not None and json.detect_encoding(raw) == "utf-8":
        inner = raw.strip(_WS)
        if inner[:1] == b"{" and inner[-1:] == b"}":
            inner = inner[:-1].rstrip(_WS)
            members = json.dumps(dict(fields), separators=(",", ":"))[1:].encode()  # '"k":v,...}'
            if len(members) == 1:  # (no fields: the closing brace alone)
                return inner + b"}"
            return inner + (b"" if inner == b"{" else b",") + members
    merged = {k: v for k, v in {**body, **fields}.items() if v is not None or k not in fields}
    return json.dumps(merged).encode()


def _upstream_error(resp_status: int, payload: Any) -> ApiError:
    err = payload.get("error", {}) if isinstance(payload, dict) else {}
    message = err.get("message") or f"engine answered {resp_status}"
    code, param = err.get("code"), err.get("param")
    return for_status(resp_status)(
        str(message),
        status=resp_status,
        type=str(err.get("type") or "server_error"),
        code=code if isinstance(code, str) else None,
        retry_after=1 if resp_status == 503 else None,
        param=param if isinstance(param, str) else None,
    )


def engine_session(headers: Mapping[str, str], request_timeout_s: float) -> EngineHttp:
    """The gateway's one client for engines: keep-alive, connect within 5 s, every read within the
    request timeout (the tenants' in-flight limits bound its connections)."""
    return EngineHttp(headers, read_timeout_s=request_timeout_s, connect_timeout_s=5.0)


_TOKENS_TIMEOUT_S = 10.0  # a tokenization: milliseconds; else go without


async def _send(
    client: EngineHttp, url: str, body: bytes | Mapping[str, Any], headers: Mapping[str, str] | None = None
) -> EngineResponse:
    """Send to the engine (``body`` encoded already, or to encode). A failure fails this request only:
    whether the engine died is for its node to say (process exit, failed health checks, a new
    registration), never inferred from one request."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        return await client.post(url, data, headers=headers)
    except engine_http.EngineTimeout as exc:
        raise GatewayTimeout(f"the engine did not answer in time ({type(exc).__name__})") from exc
    except EngineHttpError as exc:
        raise Unavailable(f"the engine is unreachable ({type(exc).__name__}); retry", retry_after=1) from exc


async def _read(resp: EngineResponse) -> bytes:
    try:
        return await resp.read()
    except engine_http.EngineTimeout as exc:
        raise GatewayTimeout(f"the engine did not answer in time ({type(exc).__name__})") from exc
    except EngineHttpError as exc:
        why = type(exc).__name__  # (never the engine's address: tenants read this)
        raise Unavailable(f"the engine answer broke off ({why}); retry", retry_after=1) from exc


async def forward_json(
    client: EngineHttp, url: str, body: bytes | Mapping[str, Any], headers: Mapping[str, str] | None = None
) -> tuple[Mapping[str, Any], TurnOutcome]:
    """Non-streaming request: the engine's JSON and what it means for the session (its bytes
    are `TurnOutcome.body`, to pass on without encoding them again)."""
    resp = await _send(client, url, body, headers)
    raw = await _read(resp)
    try:
        payload = json.loads(raw)
    except ValueError:
        raise Upstream(f"the engine answered {resp.status} without JSON") from None
    if not isinstance(payload, dict):
        raise Upstream(f"the engine answered {resp.status} without a JSON object")
    if resp.status != 200:
        raise _upstream_error(resp.status, payload)
    report = payload.get("slotkeeper")
    out = TurnOutcome(
        ok=True,
        usage=payload.get("usage") or {},
        timings=payload.get("timings") or {},
        report=report if isinstance(report, dict) else {},
        body=raw,
    )
    choices = payload.get("choices") or [{}]
    message = choices[0].get("message") or {}
    out.content = message.get("content") or choices[0].get("text") or ""
    out.tool_calls = message.get("tool_calls") or []
    return payload, out


async def input_tokens(client: EngineHttp, url: str, body: dict[str, Any]) -> list[int] | None:
    """The token ids the engine at `url` (its chat completions URL) would evaluate for `body`, from
    its `input_tokens` endpoint; None when it cannot say (any failure: this is an optimisation)."""
    try:
        data = json.dumps({**body, "with_tokens": True}).encode()
        resp = await client.post(url + "/input_tokens", data, timeout_s=_TOKENS_TIMEOUT_S)
        raw = await _read(resp)
        tokens = json.loads(raw).get("tokens") if resp.status == 200 else None
    except (ApiError, ValueError, AttributeError, EngineHttpError):
        return None
    if not isinstance(tokens, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in tokens):
        return None
    return tokens


class _Call(TypedDict):
    """A tool call as a stream's deltas (`engine_answers.ToolCallDelta`) put it together: `id` and
    `type` from the delta that names it, the name and the argument pieces that follow."""

    function: FunctionDelta
    id: NotRequired[str]
    type: NotRequired[str]


class StreamRelay:
    """An open engine stream: iterate `chunks()` to relay it; `outcome` fills in as it goes."""

    def __init__(self, response: EngineResponse) -> None:
        self._response = response
        self.outcome = TurnOutcome()
        self._buffer = b""
        self._calls: dict[int, _Call] = {}

    @classmethod
    async def open(
        cls,
        client: EngineHttp,
        url: str,
        body: bytes | Mapping[str, Any],
        headers: Mapping[str, str] | None = None,
    ) -> StreamRelay:
        resp = await _send(client, url, body, headers)
        if resp.status != 200:
            raw = await _read(resp)
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = {}
            raise _upstream_error(resp.status, payload if isinstance(payload, dict) else {})
        return cls(resp)

    def close(self) -> None:
        """Leave the stream unread: its connection is closed (the engine stops generating)."""
        self._response.close()

    def _raw(self) -> AsyncGenerator[bytes, None]:
        """The body as it arrives; the connection goes back to the pool only after a complete one
        (left early — the client went away — it is closed, which cancels the engine's request)."""
        return self._response.iter_any()

    def _observe(self, data: bytes) -> list[Mapping[str, Any]]:
        """Read the complete events in `data` (with what was buffered): the chunks they carry."""
        self._buffer += data
        chunks: list[Mapping[str, Any]] = []
        while b"\n\n" in self._buffer:
            event, self._buffer = self._buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    self.outcome.ok = not self.outcome.error
                    continue
                try:
                    chunk = json.loads(payload)
                except ValueError:
                    continue
                if isinstance(chunk, dict):
                    self._take(chunk)
                    chunks.append(chunk)
        return chunks

    def _take(self, chunk: Mapping[str, Any]) -> None:
        if "error" in chunk:
            self.outcome.error = str(chunk["error"].get("message", "engine error"))
            return
        if chunk.get("usage"):
            self.outcome.usage = chunk["usage"]
        if chunk.get("timings"):
            self.outcome.timings = chunk["timings"]
        if isinstance(chunk.get("slotkeeper"), dict):
            self.outcome.report = chunk["slotkeeper"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue  # the session continues with the first choice
            delta = choice.get("delta") or {}
            self.outcome.content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                slot = self._calls.setdefault(int(call.get("index", 0)), {"function": {"arguments": ""}})
                if call.get("id"):
                    slot["id"] = call["id"]
                    slot["type"] = call.get("type", "function")
                fn = call.get("function") or {}
                if fn.get("name"):
                    slot["function"]["name"] = fn["name"]
                slot["function"]["arguments"] += fn.get("arguments") or ""
            if choice.get("finish_reason"):
                self.outcome.ok = True
        self.outcome.tool_calls = [self._calls[i] for i in sorted(self._calls)]

    async def events(self) -> AsyncIterator[Mapping[str, Any]]:
        """The stream's chunks as objects (for a caller that re-renders them in another API's
        shape); a broken stream ends with an `{"error": ...}` object."""
        raw = self._raw()
        try:
            async for data in raw:
                for chunk in self._observe(data):
                    yield chunk
        except (EngineHttpError, TimeoutError) as exc:
            self.outcome.ok = False
            self.outcome.error = f"the engine stream broke ({type(exc).__name__})"
            yield error_payload(Unavailable(_BROKE))
        finally:
            await raw.aclose()

    async def chunks(self) -> AsyncIterator[bytes]:
        raw = self._raw()
        try:
            async for data in raw:
                self._observe(data)
                yield data
        except (EngineHttpError, TimeoutError) as exc:
            self.outcome.ok = False
            self.outcome.error = f"the engine stream broke ({type(exc).__name__})"
            yield b"data: " + json.dumps(error_payload(Unavailable(_BROKE))).encode() + b"\n\n"
        finally:
            await raw.aclose()

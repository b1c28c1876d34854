"""A recording reverse proxy in front of a gateway, for tests that drive agent CLIs: the CLI talks to
the proxy, the proxy passes every request on unchanged (method, path, query, headers, body) and
relays the answer's status, headers and bytes as they arrive (streams stay streams). It writes one
JSON line per exchange: what was asked, the status, the answer's session headers, and the prompt
and cached tokens the answer's own usage reported — the per-call numbers an agent CLI shows nobody.

It runs in its own process (`python recording_proxy.py UPSTREAM PORT LOG`); `RecordingProxy`
starts it and reads its log. Each exchange writes a `begin` line when it arrives and an `end` line
when its answer is over, so a reader can wait until nothing is in flight.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Headers that belong to one hop (RFC 9110 §7.6.1), and the framing the relay sets again itself.
_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


def usage_of(body: bytes) -> dict[str, Any]:
    """The usage an answer reported, merged in order over a JSON body or every event of an SSE
    stream (Chat Completions' last chunk, Responses' `response.completed`, Messages'
    `message_start` then `message_delta`)."""
    documents: list[Any] = []
    text = body.decode("utf-8", errors="replace")
    if text.lstrip().startswith("{"):
        try:
            documents.append(json.loads(text))
        except ValueError:
            pass
    else:
        for line in text.splitlines():
            if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                try:
                    documents.append(json.loads(line[5:]))
                except ValueError:
                    continue
    usage: dict[str, Any] = {}
    for doc in documents:
        if not isinstance(doc, dict):
            continue
        for holder in (doc, doc.get("message"), doc.get("response")):
            if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
                usage.update(holder["usage"])
    return usage


def prompt_and_cached(usage: Mapping[str, Any]) -> tuple[int, int] | None:
    """(prompt tokens, tokens read from cache) in any of the three APIs' usage shapes. Anthropic's
    `input_tokens` are only the tokens computed: its prompt is those plus the cache reads."""
    if "prompt_tokens" in usage:
        details = usage.get("prompt_tokens_details") or {}
        return int(usage["prompt_tokens"]), int(details.get("cached_tokens") or 0)
    if "cache_read_input_tokens" in usage:
        read = int(usage.get("cache_read_input_tokens") or 0)
        written = int(usage.get("cache_creation_input_tokens") or 0)
        return int(usage.get("input_tokens") or 0) + read + written, read
    if "input_tokens" in usage:
        details = usage.get("input_tokens_details") or {}
        return int(usage["input_tokens"]), int(details.get("cached_tokens") or 0)
    return None


@dataclass(frozen=True)
class Exchange:
    """One request through the proxy and what its answer said."""

    seq: int
    method: str
    path: str
    headers: dict[str, str]  # the request's, names lower-cased
    body: Any  # the request's JSON, or its text when it is not JSON
    status: int
    answer_headers: dict[str, str]
    answer: str  # the answer's text (bounded)
    broken: str | None  # how the upstream broke off mid-answer, if it did
    prompt: int | None
    cached: int | None
    began: float  # wall-clock seconds: when the request arrived and when its answer was over
    ended: float

    @property
    def reuse(self) -> float:
        """Share of the prompt read from cache."""
        return (self.cached or 0) / self.prompt if self.prompt else 0.0


class RecordingProxy:
    """The proxy process on a free loopback port in front of `upstream`, logging to `log`."""

    def __init__(self, upstream: str, log: Path, port: int) -> None:
        self.upstream = upstream
        self.log = log
        self.url = f"http://127.0.0.1:{port}"
        self._port = port
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        from support.ready import wait_ready

        stderr = self.log.with_suffix(".stderr")
        with stderr.open("wb") as out:
            self._proc = subprocess.Popen(
                [sys.executable, __file__, self.upstream, str(self._port), str(self.log)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_ready(self.url, self._proc, stderr, timeout=30)  # the gateway's /ready, through it

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(10)

    def mark(self) -> int:
        """The number of exchanges begun so far: `exchanges(after=mark)` are the ones after now."""
        return max(self._read()[0], default=0)

    def exchanges(self, after: int = 0, timeout: float = 30) -> list[Exchange]:
        """Every finished exchange so far, in arrival order, once none is in flight (a CLI may
        exit before the proxy has written the end of its last answer)."""
        deadline = time.monotonic() + timeout
        while True:
            begun, ended = self._read()
            if begun <= ended.keys() or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert begun <= ended.keys(), f"exchanges {sorted(begun - ended.keys())} never finished"
        return [ended[seq] for seq in sorted(ended) if seq > after]

    def _read(self) -> tuple[set[int], dict[int, Exchange]]:
        begun: set[int] = set()
        ended: dict[int, Exchange] = {}
        if not self.log.exists():
            return begun, ended
        for line in self.log.read_text(encoding="utf-8").splitlines():
            if not line.endswith("}"):
                continue  # a line being written
            doc = json.loads(line)
            if doc.pop("event") == "begin":
                begun.add(doc["seq"])
            else:
                ended[doc["seq"]] = Exchange(**doc)
        return begun, ended


def _serve(upstream: str, port: int, log_path: Path) -> None:
    import contextlib

    import httpx
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    state: dict[str, Any] = {"seq": 0}
    log = log_path.open("a", encoding="utf-8")

    def write(doc: dict[str, Any]) -> None:
        log.write(json.dumps(doc) + "\n")
        log.flush()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with httpx.AsyncClient(base_url=upstream, timeout=None) as client:
            client.headers.clear()  # no default headers of httpx's: the client's own go on
            state["client"] = client
            yield

    async def forward(request: Request) -> Response:
        began = time.time()
        state["seq"] += 1
        seq = state["seq"]
        write({"event": "begin", "seq": seq})
        raw = await request.body()
        headers = [(k, v) for k, v in request.headers.raw if k.decode("latin-1").lower() not in _HOP]
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        client: httpx.AsyncClient = state["client"]
        answer = await client.send(
            client.build_request(request.method, target, headers=headers, content=raw), stream=True
        )
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", errors="replace")

        async def relay() -> AsyncIterator[bytes]:
            received: list[bytes] = []
            broken = None
            try:
                async for chunk in answer.aiter_raw():
                    received.append(chunk)
                    yield chunk
            except httpx.HTTPError as exc:  # the upstream broke off: so does the relay, as it did
                broken = f"{type(exc).__name__}: {exc}"
                raise
            finally:
                await answer.aclose()
                text = b"".join(received)
                counts = prompt_and_cached(usage_of(text)) if answer.status_code == 200 else None
                write(
                    {
                        "event": "end",
                        "seq": seq,
                        "method": request.method,
                        "path": request.url.path,
                        "headers": {k.lower(): v for k, v in request.headers.items()},
                        "body": body,
                        "status": answer.status_code,
                        "answer_headers": {k.lower(): v for k, v in answer.headers.items()},
                        "answer": text[:65536].decode("utf-8", errors="replace"),
                        "broken": broken,
                        "prompt": counts[0] if counts else None,
                        "cached": counts[1] if counts else None,
                        "began": began,
                        "ended": time.time(),
                    }
                )

        kept = [(k, v) for k, v in answer.headers.raw if k.decode("latin-1").lower() not in _HOP]
        response = StreamingResponse(relay(), status_code=answer.status_code)
        response.raw_headers = kept
        return response

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
    app = Starlette(routes=[Route("/{path:path}", forward, methods=methods)], lifespan=lifespan)
    # The upstream's own Date and Server headers go on: uvicorn adds none of its own.
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        ws="none",
        access_log=False,
        server_header=False,
        date_header=False,
    )


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))

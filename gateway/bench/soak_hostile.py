"""The soak's hostile tenant: every input of `KINDS`, round after round, each answer judged against
what the gateway owes it (a precise 4xx, a 429 with Retry-After, a closed connection)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypedDict
from urllib.parse import urlsplit

import httpx

from gateway.bench.soak_state import (
    HEADER_TIMEOUT_S,
    HOSTILE_INFLIGHT,
    HOSTILE_KEY,
    HOSTILE_RPM,
    WORDS,
    Kind,
    Soak,
    retry_after,
)

KINDS = {  # hostile input -> what is expected of the gateway (each check is in Hostile's code)
    "grammar: 50k nested parens": "400",
    "json_schema: 3,000 properties": "200|400 within 30 s",
    "60 MB body, Content-Length": "413",
    "60 MB body, chunked": "413",
    "JSON nested 100,000 deep": "400",
    "messages not objects": "400",
    "X-Session-Id ../x, 129 chars": "400",
    "node API without the key": "401",
    "delete, then reuse the id": "200 each, reuse cold",
    "X-Session-Id dot2. while busy": "200 (or forked)",
    "300 random 404 paths": "404",
    "burst over in-flight limit": "200|429+Retry-After, some 429",
    "burst over requests/minute": "429 + Retry-After",
    "trickled headers": f"closed within {HEADER_TIMEOUT_S:.0f} s",
}


class RequestOptions(TypedDict, total=False):
    """What a probe hands `httpx.AsyncClient.request`: a JSON body, or raw bytes, and headers."""

    json: object
    content: bytes
    headers: dict[str, str]


Probe = tuple[str, frozenset[int], str, str, RequestOptions]  # kind, good statuses, method, url, kw


class Hostile:
    """The hostile tenant: every input of KINDS, round after round, until the deadline."""

    def __init__(self, soak: Soak, client: httpx.AsyncClient, rng: random.Random) -> None:
        self.soak, self.client, self.rng = soak, client, rng
        self.auth = {"Authorization": f"Bearer {HOSTILE_KEY}"}
        self.chat = soak.url + "/v1/chat/completions"
        parts = urlsplit(soak.url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.last_rpm_burst = -math.inf  # the first rate-limit burst ends round 2
        self.round = 0
        soak.kinds.update({name: Kind(expect) for name, expect in KINDS.items()})

    def body(self, text: str, **extra: object) -> dict[str, object]:
        """A chat request of the hostile tenant (its JSON), with `extra` fields."""
        msgs = [{"role": "user", "content": text}]
        return {"model": self.soak.model, "messages": msgs, "max_tokens": 4, "temperature": 0, **extra}

    def probes(self) -> list[Probe]:
        """The inputs that are one request each, as a table."""
        chat, node, engine = self.chat, self.soak.node_url, self.soak.engine_id
        props = {f"field_{i}": {"type": "string"} for i in range(3000)}
        wide = {
            "type": "json_schema",
            "json_schema": {"name": "wide", "schema": {"type": "object", "properties": props}},
        }
        parens = "(" * 50_000 + ")" * 50_000
        deep = b'{"model": "x", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        ref, s400, s401 = {"tenant": "mallory", "session": "h-reuse", "generation": 1}, {400}, {401}
        unkeyed: list[tuple[str, str, RequestOptions]] = [
            ("GET", "/v1/engines", {}),
            ("GET", "/metrics", {}),
            ("POST", f"/v1/engines/{engine}/slots/0/spill", {"json": ref}),
            ("POST", f"/v1/engines/{engine}/slots/0/fill", {"json": ref}),
            ("POST", f"/v1/engines/{engine}/slots/0/erase", {}),
            ("DELETE", "/v1/sessions/alpha/alpha-s00-e0", {}),
        ]
        table: list[tuple[str, set[int], str, str, RequestOptions]] = [
            (
                "grammar: 50k nested parens",
                s400,
                "POST",
                chat,
                {"json": self.body("hi", grammar=parens), "headers": {**self.auth, "X-Session-Id": "h-gr"}},
            ),
            (
                "json_schema: 3,000 properties",
                {200, 400},
                "POST",
                chat,
                {
                    "json": self.body("fill in", response_format=wide),
                    "headers": {**self.auth, "X-Session-Id": "h-schema"},
                },
            ),
            (
                "JSON nested 100,000 deep",
                s400,
                "POST",
                chat,
                {"content": deep, "headers": {**self.auth, "Content-Type": "application/json"}},
            ),
            (
                "messages not objects",
                s400,
                "POST",
                chat,
                {
                    "headers": self.auth,
                    "json": {"model": self.soak.model, "messages": ["hello", 42, None], "max_tokens": 4},
                },
            ),
            *(
                (
                    "X-Session-Id ../x, 129 chars",
                    s400,
                    "POST",
                    chat,
                    RequestOptions(json=self.body("hi"), headers={**self.auth, "X-Session-Id": sid}),
                )
                for sid in ("../x", "x" * 129)
            ),
            *(("node API without the key", s401, method, node + path, kw) for method, path, kw in unkeyed),
        ]
        return [(kind, frozenset(good), method, url, kw) for kind, good, method, url, kw in table]

    async def run(self) -> None:
        steps: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
            *((p[0], lambda p=p: self.call(*p)) for p in self.probes()),
            ("60 MB body, Content-Length", lambda: self.huge_body(chunked=False)),
            ("60 MB body, chunked", lambda: self.huge_body(chunked=True)),
            ("delete, then reuse the id", self.delete_reuse),
            ("X-Session-Id dot2. while busy", self.fork_dot2),
            ("300 random 404 paths", self.not_found),
            ("burst over in-flight limit", self.inflight_burst),
            ("burst over requests/minute", self.rpm_burst),
        ]
        while self.soak.left() > 0:
            self.round += 1
            for kind, step in steps:
                if self.soak.left() <= 0:
                    return
                try:
                    await step()
                except (httpx.HTTPError, OSError, TimeoutError) as exc:
                    self.soak.note(kind, "transport error", False, f"{type(exc).__name__}: {exc}")

    async def call(
        self, kind: str, good: frozenset[int], method: str, url: str, kw: RequestOptions
    ) -> httpx.Response | None:
        """One request of `kind`. A 429/503 with Retry-After outside `good` (the rate window spent, an
        engine restarting, a backend away) is waited out, twice at most, and then counted as what it
        is — a legitimate "come back later", never against the input; any other status is judged."""
        for attempt in range(3):
            t0 = time.perf_counter()
            r = await self.client.request(method, url, **kw)
            ms = (time.perf_counter() - t0) * 1000
            wait = retry_after(r)
            if r.status_code in (429, 503) and r.status_code not in good and wait is not None:
                self.soak.kinds[kind].throttled += 1
                if attempt == 2 or wait + 1 > self.soak.left():
                    return None  # still unavailable (or the soak ends first): nothing to judge
                await asyncio.sleep(wait)
                continue
            status, ok = str(r.status_code), r.status_code in good
            if ok and kind.startswith("json_schema") and ms > 30_000:
                status, ok = f"{r.status_code} after {ms / 1000:.0f} s", False
            self.soak.note(kind, status, ok, r.text, ms)
            return r
        return None

    async def huge_body(self, chunked: bool) -> None:
        """60 MB from a raw socket while its answer is read: 413 (the gateway may close without
        reading the rest; writing then fails, which is fine)."""
        kind = f"60 MB body, {'chunked' if chunked else 'Content-Length'}"
        total, chunk = 60 << 20, b" " * (1 << 20)
        framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}"
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {self.host}\r\nAuthorization: Bearer "
            f"{HOSTILE_KEY}\r\nContent-Type: application/json\r\n{framing}\r\nConnection: close\r\n\r\n"
        )
        reader, writer = await asyncio.open_connection(self.host, self.port)

        async def write() -> None:
            writer.write(head.encode())
            for _ in range(total // len(chunk)):
                writer.write(b"100000\r\n" + chunk + b"\r\n" if chunked else chunk)
                await writer.drain()
            writer.write(b"0\r\n\r\n" if chunked else b"")
            await writer.drain()

        t0 = time.perf_counter()
        sender = asyncio.create_task(write())
        answer: list[bytes] = []  # its status line and headers
        try:
            async with asyncio.timeout(60):
                while (line := await reader.readline()) not in (b"", b"\r\n") and len(answer) < 64:
                    answer.append(line)
        except (TimeoutError, ConnectionError):
            pass
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError, OSError):
                await sender
            writer.close()
        first = answer[0] if answer else b""
        status = first.split()[1].decode() if first.startswith(b"HTTP/") else "closed without an answer"
        ms = (time.perf_counter() - t0) * 1000
        later = any(h.lower().startswith(b"retry-after:") for h in answer[1:])
        if status == "503" and later:  # a backend away: "come back later" is a legitimate answer
            self.soak.kinds[kind].throttled += 1
            return
        self.soak.note(kind, status, status == "413", first.decode(errors="replace"), ms)

    async def delete_reuse(self) -> None:
        """A turn, DELETE, a turn with the same id: a new, cold session (the old state must not return)."""
        kind, sid, ok = "delete, then reuse the id", "h-reuse", frozenset({200})
        turn: RequestOptions = {
            "json": self.body("remember: 7"),
            "headers": {**self.auth, "X-Session-Id": sid},
        }
        delete: RequestOptions = {"headers": self.auth}
        for method, url, kw in (
            ("POST", self.chat, turn),
            ("DELETE", f"{self.soak.url}/v1/sessions/{sid}", delete),
        ):
            r = await self.call(kind, ok, method, url, kw)
            if r is None or r.status_code != 200:
                return
        again = await self.call(kind, ok, "POST", self.chat, turn)
        if again is not None and again.status_code == 200:
            cache = again.headers.get("x-slotkeeper-cache", "-")
            if cache != "cold" or again.headers.get("x-session-id") != sid:
                self.soak.note(kind, f"reuse served {cache}", False, "a deleted session's state came back")

    async def fork_dot2(self) -> None:
        """Two turns of `dot2.` at once: one finds it busy and is served by a fork (deleted after)."""
        kind, ok = "X-Session-Id dot2. while busy", frozenset({200})
        kw: RequestOptions = {
            "json": self.body(f"count slowly to fifty, round {self.round}", max_tokens=48),
            "headers": {**self.auth, "X-Session-Id": "dot2."},
        }
        first = asyncio.create_task(self.call(kind, ok, "POST", self.chat, kw))
        await asyncio.sleep(0.05)
        second = await self.call(kind, ok, "POST", self.chat, kw)
        for r in (await first, second):
            fork = r.headers.get("x-session-id", "") if r is not None and r.status_code == 200 else "dot2."
            if fork != "dot2.":
                self.soak.note(kind, "forked", fork.startswith("dot2") and ".." not in fork, fork)
                await self.call(
                    kind, ok, "DELETE", f"{self.soak.url}/v1/sessions/{fork}", {"headers": self.auth}
                )

    async def not_found(self) -> None:
        for _ in range(300):
            url = f"{self.soak.url}/h404-{secrets.token_hex(6)}/{self.rng.choice(WORDS)}"
            await self.call("300 random 404 paths", frozenset({404}), "GET", url, {"headers": self.auth})

    async def inflight_burst(self) -> None:
        """More turns at once than the tenant's in-flight limit: the excess gets 429 + Retry-After."""
        kind, n = "burst over in-flight limit", HOSTILE_INFLIGHT + 4

        async def one(i: int) -> httpx.Response:
            headers = {**self.auth, "X-Session-Id": f"h-burst-{i}"}
            return await self.client.post(self.chat, json=self.body("burst", max_tokens=16), headers=headers)

        for r in await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True):
            if isinstance(r, BaseException):
                self.soak.note(kind, "transport error", False, f"{type(r).__name__}: {r}")
                continue
            limited = r.status_code in (429, 503) and retry_after(r) is not None
            self.soak.note(kind, str(r.status_code), r.status_code == 200 or limited, r.text)
        if self.round == 3 and self.soak.kinds[kind].statuses["429"] == 0:
            self.soak.note(kind, "no 429 in 3 bursts", False, f"{n} at once, limit {HOSTILE_INFLIGHT}")

    async def rpm_burst(self) -> None:
        """Cheap requests (refused with 400 after the rate check) until a 429, then wait it out."""
        if self.round < 2 or time.monotonic() - self.last_rpm_burst < 90:
            return
        self.last_rpm_burst = time.monotonic()
        kind, body = (
            "burst over requests/minute",
            {"model": self.soak.model, "messages": [7], "max_tokens": 1},
        )
        # Windows are calendar minutes: a burst across a boundary splits its count, so send enough
        # that one of the two windows is over the limit whatever the timing.
        for _ in range(2 * HOSTILE_RPM + 50):
            try:
                r = await self.client.post(self.chat, json=body, headers=self.auth)
            except httpx.TransportError as exc:  # counted; the burst goes on
                self.soak.note(kind, "transport error", False, f"{type(exc).__name__}: {exc}")
                continue
            if r.status_code == 429:
                wait = retry_after(r)
                self.soak.note(kind, "429", wait is not None and wait <= 61, r.text)
                await asyncio.sleep(max(0.0, min(wait or 0.0, self.soak.left())))
                return
            wait = retry_after(r)
            if r.status_code == 503 and wait is not None:  # the model's engine is restarting (a SIGKILL)
                self.soak.kinds[kind].throttled += 1
                await asyncio.sleep(max(0.0, min(wait, self.soak.left())))
                continue
            self.soak.note(kind, str(r.status_code), r.status_code == 400, r.text)
        self.soak.note(kind, "never 429", False, f"{2 * HOSTILE_RPM + 50} requests, limit {HOSTILE_RPM}/min")

    async def trickle(self) -> None:
        """Slowloris, in its own task: a request head at one byte a second; how long it is held."""
        kind, limit = "trickled headers", HEADER_TIMEOUT_S + 5
        head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 4096
        while self.soak.left() > limit + 15:
            reader, writer = await asyncio.open_connection(self.host, self.port)
            t0, outcome = time.monotonic(), "held"
            try:
                for i in range(int(HEADER_TIMEOUT_S) + 20):
                    try:
                        writer.write(head[i : i + 1])
                        await writer.drain()
                        data = await asyncio.wait_for(reader.read(256), 1.0)  # the pacing: 1 byte/s
                    except TimeoutError:
                        continue
                    except ConnectionError:
                        data = b""
                    outcome = data.split(b"\r\n", 1)[0].decode(errors="replace") or "closed"
                    break
            finally:
                writer.close()
            held = time.monotonic() - t0
            status = "held" if outcome == "held" else "closed"
            self.soak.note(kind, status, held <= limit, f"{outcome} after {held:.1f} s", held * 1000)

"""The floor of a Python HTTP gateway on this host, for `bench gateway`'s overhead table: a bare
ASGI app under uvicorn (uvloop, httptools, as the gateway runs) that passes a chat request's body to
one engine over `gateway.engine_http` and its answer back — no tenants, sessions, Redis, routing
or validation. What the gateway adds beyond this is its own work; what this adds over a direct
call is the second HTTP hop any gateway pays.

    python -m gateway.bench.floor_proxy --port P --engine http://127.0.0.1:E

(SLOTKEEPER_INTERNAL_KEY: its key)
"""

from __future__ import annotations

import argparse
import os

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.engine_http import EngineHttp

_JSON = [(b"content-type", b"application/json")]


def build(engine: str, key: str) -> ASGIApp:
    client = EngineHttp({"authorization": f"Bearer {key}"}, read_timeout_s=600)
    target = engine.rstrip("/") + "/v1/chat/completions"

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await receive()  # startup
            await send({"type": "lifespan.startup.complete"})
            await receive()  # shutdown
            await client.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        resp = await client.post(target, body)
        raw = await resp.read()
        headers = [*_JSON, (b"content-length", str(len(raw)).encode())]
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        await send({"type": "http.response.body", "body": raw})

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--engine", required=True)
    args = ap.parse_args()
    app = build(args.engine, os.environ["SLOTKEEPER_INTERNAL_KEY"])
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        proxy_headers=False,
        lifespan="on",
        loop="uvloop",
        http="httptools",
    )


if __name__ == "__main__":
    main()

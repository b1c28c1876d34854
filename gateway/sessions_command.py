"""`slotkeeper sessions`: list, show and delete sessions, through a running gateway or straight from
the data directory of a `serve` that is not running.

    slotkeeper sessions [list]       [--url URL | --data-dir DIR] [--key KEY] [--tenant T] [--json]
    slotkeeper sessions show ID      (same options)
    slotkeeper sessions delete ID    (same options)

Through a gateway (the default: serve's http://127.0.0.1:8000) it asks the API (`GET /v1/sessions`,
`GET|DELETE /v1/sessions/{id}`) with the tenant's key (`--key` or SLOTKEEPER_API_KEY). From a data
directory it reads the local store's manifests: what a restart would restore, generation by
generation; a delete there removes every stored generation and spill-cache file of the session
(stop serve first: a running one keeps what it holds in its slots). Exit status: 0, 1 when the
session is not found or the gateway refuses, 2 for usage or I/O errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from engine_pool.http.answers import answer_json, error_object
from storage.blobs.blobstore import delete_generations
from storage.blobs.localstore import LocalStore
from storage.blobs.spillcache import SpillCache
from storage.chunks.chunkstore import ChunkedStore
from storage.chunks.ledger import ChunkLedger
from storage.errors import NotStored, StorageError
from storage.index.prefix_digests import split_routes
from storage.index.session_index import in_process_redis

DEFAULT_URL = "http://127.0.0.1:8000"
COLUMNS = ("id", "state", "generation", "tokens", "bytes", "last_used")


class Refused(Exception):
    """The gateway or the store said no (not found, a bad key): exit 1 with its words."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slotkeeper sessions", description="List, show and delete sessions.")
    p.add_argument("action", nargs="?", default="list", choices=("list", "show", "delete"))
    p.add_argument("session", nargs="?", help="the session id (show, delete)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", help=f"a running gateway ({DEFAULT_URL})")
    where.add_argument("--data-dir", help="serve's data directory, read directly (serve stopped)")
    p.add_argument(
        "--key", help="the tenant's API key (env SLOTKEEPER_API_KEY; none for serve's open tenant)"
    )
    p.add_argument("--tenant", default="default", help="with --data-dir: whose sessions (default)")
    p.add_argument("--prefix", default="slotkeeper", help="with --data-dir: serve's --s3-prefix (slotkeeper)")
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


# -- through a gateway -------------------------------------------------------------------------------
def _via_gateway(url: str, key: str | None, action: str, session: str | None) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    path = "/v1/sessions" + (f"/{session}" if session else "")
    method = "DELETE" if action == "delete" else "GET"
    try:
        r = httpx.request(method, url.rstrip("/") + path, headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise OSError(
            f"cannot reach the gateway at {url} ({type(exc).__name__}: {exc}); is serve running there "
            "(else --url URL)? With serve stopped, read its data directory instead: --data-dir DIR "
            "(serve's --data-dir, .slotkeeper by default)"
        ) from exc
    body = answer_json(r)
    if r.status_code != 200:
        message = (error_object(body) or {}).get("message")
        raise Refused(f"{r.status_code}: {message or r.text[:200]}")
    if body is None:
        body = {}
    return body.get("data", body) if action == "list" else body


# -- from a data directory ---------------------------------------------------------------------------
async def _via_data_dir(data: Path, prefix: str, tenant: str, action: str, session: str | None) -> Any:
    if not (data / "blobs").is_dir():
        raise OSError(f"{data} holds no store (no blobs/ folder): is it serve's --data-dir?")
    redis = in_process_redis()  # (the ledger's counts are rebuilt by serve; collection goes by manifests)
    store = ChunkedStore(LocalStore(data / "blobs", prefix=prefix), ChunkLedger(redis, prefix="sessions"))
    try:
        if action == "list":
            newest = await store.latest_per_session(tenant)
            return [await _stored(store, info.ref) for _, info in sorted(newest.items())]
        assert session is not None
        refs = [info.ref async for info in store.list(tenant, session)]
        if not refs:
            raise Refused(f"session {session} not found in {data}")
        if action == "show":
            out = await _stored(store, max(refs, key=lambda r: r.generation))
            out["generations"] = sorted(r.generation for r in refs)
            return out
        deleted = await delete_generations(store, tenant, session)
        spill = await SpillCache.open(data / "spill", max_bytes=0)
        for ref in spill.session_refs(tenant, session):
            await spill.discard(ref)
        return {
            "id": session,
            "object": "session",
            "deleted": True,
            "generations": [r.generation for r in deleted],
        }
    finally:
        await redis.aclose()


async def _stored(store: ChunkedStore, ref: Any) -> dict[str, Any]:
    meta = await store.head(ref)
    route, shared, prompt, head = split_routes(meta.route)
    return {
        "id": ref.session,
        "state": "stored",
        "generation": ref.generation,
        "tokens": meta.n_tokens,
        "bytes": meta.size,
        "last_used": meta.last_modified,
        "model": meta.model,
        "route": route,
        "shared": shared,
        "prompt": prompt,
        "head": head,
    }


# -- output -----------------------------------------------------------------------------------------
def _cell(name: str, value: Any) -> str:
    if name == "last_used" and isinstance(value, int | float) and value > 0:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value))
    return "" if value is None else str(value)


def render(action: str, result: Any) -> str:
    if action == "list":
        rows = [[_cell(c, r.get(c)) for c in COLUMNS] for r in result]
        widths = [max([len(c), *(len(row[i]) for row in rows)]) for i, c in enumerate(COLUMNS)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True))]
        lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
        return "\n".join(lines + [f"({len(rows)} sessions)"])
    return "\n".join(f"{k:<12} {_cell(k, v)}" for k, v in result.items())


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``slotkeeper sessions``; ``argv`` excludes the program name."""
    args = _parser().parse_args(argv)
    if args.action != "list" and not args.session:
        print(f"slotkeeper sessions {args.action}: a session id is required", file=sys.stderr)
        return 2
    try:
        if args.data_dir:
            result = asyncio.run(
                _via_data_dir(Path(args.data_dir), args.prefix, args.tenant, args.action, args.session)
            )
        else:
            key = args.key or os.environ.get("SLOTKEEPER_API_KEY")
            result = _via_gateway(args.url or DEFAULT_URL, key, args.action, args.session)
    except Refused as exc:
        print(f"slotkeeper sessions: {exc}", file=sys.stderr)
        return 1
    except (OSError, StorageError, NotStored) as exc:
        print(f"slotkeeper sessions: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else render(args.action, result))
    return 0

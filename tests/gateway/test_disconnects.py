"""A client that goes away takes its generation with it, through `slotkeeper serve`.

A non-streamed chat is cancelled at the engine once its client disconnects (the gateway closes its
engine connection, the engine's disconnect watcher cancels the generation), streamed or not, so a
slot nobody waits for is free again at once and an honest request is served next.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.servers import INTERNAL_AUTH

pytestmark = pytest.mark.slow

LONG: dict[str, Any] = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Write a very long story."}],
    "max_tokens": 30000,
    "ignore_eos": True,
    "temperature": 0,
}


def busy_slots(serve: Any) -> int:
    n = 0
    for e in serve.engines():
        slots = httpx.get(e["url"] + "/slots", headers=INTERNAL_AUTH, timeout=5).json()
        n += sum(1 for s in slots if s.get("is_processing"))
    return n


async def until(probe: Any, what: str, within_s: float) -> float:
    """Seconds until `probe()` held (fails past `within_s`)."""
    t0 = time.monotonic()
    while not probe():
        if time.monotonic() - t0 > within_s:
            raise AssertionError(f"not {what} within {within_s} s")
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_leaves_frees_its_slot(serve: Any, tmp_path: Path, stream: bool) -> None:
    s = serve(tmp_path / "data", slots=1, args=("--ctx", "32768"))
    async with httpx.AsyncClient(base_url=s.url, timeout=120) as client:
        leaving = asyncio.ensure_future(client.post("/v1/chat/completions", json={**LONG, "stream": stream}))
        await until(lambda: busy_slots(s) == 1, "generating", within_s=30)
        leaving.cancel()  # the client goes away: its connection closes
        with pytest.raises(asyncio.CancelledError):
            await leaving
        freed_s = await until(lambda: busy_slots(s) == 0, "free again", within_s=5)
        honest = await client.post(
            "/v1/chat/completions",
            json={**LONG, "max_tokens": 4, "ignore_eos": False},
            headers={"X-Session-Id": "honest"},
        )
        assert honest.status_code == 200, honest.text
    print(f"slot free {freed_s * 1000:.0f} ms after the client left (stream={stream})")

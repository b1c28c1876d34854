"""A client that goes away takes its generation with it, through `slotkeeper serve`.

A non-streamed chat is cancelled at the engine once its client disconnects (the gateway closes its
engine connection, the engine's disconnect watcher cancels the generation), streamed or not, so a
slot nobody waits for is free again at once and an honest request is served next.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.bench.harness.servers import INTERNAL_AUTH

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


async def test_delete_of_a_busy_session_ends_its_turn_and_answers(serve: Any, tmp_path: Path) -> None:
    s = serve(tmp_path / "data", slots=1, args=("--ctx", "32768"))
    async with httpx.AsyncClient(base_url=s.url, timeout=120) as client:
        short = {**LONG, "max_tokens": 2, "ignore_eos": False}
        warm = await client.post("/v1/chat/completions", json=short, headers={"X-Session-Id": "busy"})
        assert warm.status_code == 200, warm.text
        running = asyncio.ensure_future(
            client.post("/v1/chat/completions", json=LONG, headers={"X-Session-Id": "busy"})
        )
        await until(lambda: busy_slots(s) == 1, "generating", within_s=30)
        t0 = time.monotonic()
        deleted = await client.delete("/v1/sessions/busy")
        took = time.monotonic() - t0
        assert deleted.status_code == 200, deleted.text
        assert deleted.json() == {"id": "busy", "object": "session", "deleted": True}
        answer = await running  # its client got what was written before the DELETE
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] < LONG["max_tokens"]
        assert (await client.get("/v1/sessions/busy")).status_code == 404
        assert busy_slots(s) == 0
    print(f"DELETE of a busy session answered in {took * 1000:.0f} ms")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
async def test_ctrl_c_during_a_generation_exits_well_within_the_grace(
    serve: Any, tmp_path: Path, sig: signal.Signals
) -> None:
    """The drain ends running generations instead of waiting for their slots (the drain grace is
    60 s, a slot operation waits 30 s for a busy slot): serve exits cleanly soon after the signal."""
    s = serve(tmp_path / "data", slots=1, args=("--ctx", "32768"))
    async with httpx.AsyncClient(base_url=s.url, timeout=120) as client:
        running = asyncio.ensure_future(
            client.post("/v1/chat/completions", json=LONG, headers={"X-Session-Id": "long"})
        )
        await until(lambda: busy_slots(s) == 1, "generating", within_s=30)
        t0 = time.monotonic()
        s.proc.send_signal(sig)
        code = await asyncio.to_thread(s.proc.wait, 30)
        took = time.monotonic() - t0
        with contextlib.suppress(httpx.HTTPError):
            await running
    assert code == 0, s.log.read_text()[-3000:]  # within 30 s: a drain that waited for the slot took longer
    print(f"exited {took:.1f} s after {sig.name}")

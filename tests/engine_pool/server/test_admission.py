"""Slots under contention: the bounded queue, slot operations waiting for a busy slot, disconnects, the
API key, and shutdown while a stream is running — against one engine of one slot with a long context.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ..conftest import EngineProcess, run_engine

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG_RUN = {"prompt": "Hello world", "n_predict": 30000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def busy_engine(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    yield from run_engine(
        tmp_path_factory,
        models["llama"],
        *("-np", "1", "-c", "40000", "--queue-size", "1", "--slot-wait-timeout", "1"),
        *("--slot-save-path", str(tmp_path_factory.mktemp("busy-slots"))),
        *("--api-key", KEY),
    )


@pytest.fixture
async def client(busy_engine: EngineProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=busy_engine.url, headers=AUTH, timeout=30) as c:
        yield c


async def _slots(c: httpx.AsyncClient) -> list[dict[str, Any]]:
    r = await c.get("/slots")
    assert r.status_code == 200, r.text
    out: list[dict[str, Any]] = r.json()
    return out


async def _until(pred: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def _first_line(lines: AsyncIterator[str]) -> str:
    async for line in lines:
        if line.startswith("data: "):
            return line
    raise AssertionError("stream ended without data")


async def test_full_queue_is_503_and_the_queue_runs_after_a_disconnect(client: httpx.AsyncClient) -> None:
    async with client.stream("POST", "/completion", json={**LONG_RUN, "stream": True}) as stream:
        assert stream.status_code == 200
        lines = stream.aiter_lines()  # kept: a dropped line iterator closes the response
        await _first_line(lines)
        waiting = asyncio.create_task(
            client.post("/completion", json={"prompt": "Hi", "n_predict": 3, "id_slot": 0})
        )

        async def queued() -> bool:
            return (await _slots(client))[0]["queued"] == 1

        await _until(queued)
        full = await client.post("/completion", json={"prompt": "Hi", "n_predict": 3})
        assert full.status_code == 503
        assert full.headers["retry-after"] == "1"
        assert full.json()["error"]["type"] == "unavailable_error"
        assert "queue is full" in full.json()["error"]["message"]
        # Slot operations are bounded by their wait, not by the queue: this one waits its turn.
        erase = asyncio.create_task(client.post("/slots/0?action=erase"))
        await asyncio.sleep(0.2)
        assert not erase.done()
    # Leaving the stream closed the connection: the long request is cancelled, the queue moves on.
    done = await waiting
    assert done.status_code == 200 and done.json()["tokens_predicted"] == 3
    erased = await erase
    assert erased.status_code == 200, erased.text
    assert erased.json()["n_erased"] > 0


async def test_slot_operation_on_a_busy_slot_gives_up_after_its_wait(client: httpx.AsyncClient) -> None:
    async with client.stream("POST", "/completion", json={**LONG_RUN, "stream": True}) as stream:
        lines = stream.aiter_lines()
        await _first_line(lines)
        t0 = time.monotonic()
        r = await client.post("/slots/0?action=save", json={"filename": "busy.slot"})
        assert r.status_code == 409
        assert r.json()["error"]["type"] == "slot_busy_error"
        assert "still busy after 1 s" in r.json()["error"]["message"]
        assert 0.9 <= time.monotonic() - t0 < 5


async def test_non_stream_request_is_cancelled_when_the_client_goes_away(client: httpx.AsyncClient) -> None:
    with pytest.raises(httpx.ReadTimeout):
        await client.post("/completion", json=LONG_RUN, timeout=0.5)

    async def idle() -> bool:
        return not (await _slots(client))[0]["is_processing"]

    await _until(idle, timeout_s=5)
    r = await client.post("/completion", json={"prompt": "Hi", "n_predict": 2})
    assert r.status_code == 200


async def test_api_key(busy_engine: EngineProcess) -> None:
    async with httpx.AsyncClient(base_url=busy_engine.url) as c:
        r = await c.post("/completion", json={"prompt": "Hi", "n_predict": 1})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = await c.get("/slots", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/v1/models")).status_code == 200
        r = await c.post("/tokenize", json={"content": "Hi"}, headers={"X-Api-Key": KEY})
        assert r.status_code == 200


def test_sigterm_aborts_a_running_stream_with_an_error_event(models: dict[str, Path], tmp_path: Path) -> None:
    eng = EngineProcess(
        models["llama"],
        "-np",
        "1",
        "-c",
        "40000",
        "--shutdown-grace",
        "0.5",
        log_path=tmp_path / "engine.log",
    ).start()
    try:
        with (
            httpx.Client(base_url=eng.url, timeout=30) as c,
            c.stream("POST", "/v1/completions", json={**LONG_RUN, "stream": True}) as stream,
        ):
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert eng.proc is not None
            eng.proc.terminate()
            events = [line[6:] for line in lines if line.startswith("data: ")]
        last = json.loads(events[-1])
        assert last["error"]["type"] == "unavailable_error"
        assert "shutting down" in last["error"]["message"]
    finally:
        assert eng.stop() == 0
    assert "engine.draining" in eng.log() and "engine.closed" in eng.log()


async def test_cancel_ends_the_slots_generation_and_its_client_gets_what_was_written(
    client: httpx.AsyncClient,
) -> None:
    running = asyncio.ensure_future(client.post("/completion", json=LONG_RUN))

    async def busy() -> bool:
        return bool((await _slots(client))[0]["is_processing"])

    await _until(busy)
    r = await client.post("/slots/0?action=cancel")
    assert r.status_code == 200, r.text
    assert r.json() == {"id_slot": 0, "cancelled": True}
    answer = await asyncio.wait_for(running, 10)
    assert answer.status_code == 200, answer.text
    assert 0 < answer.json()["tokens_predicted"] < LONG_RUN["n_predict"]

    async def idle() -> bool:
        return not (await _slots(client))[0]["is_processing"]

    await _until(idle)
    again = await client.post("/slots/0?action=cancel")
    assert again.json() == {"id_slot": 0, "cancelled": False}  # nothing runs there now

"""gateway.turn.restore_progress: a streamed turn that asks for `return_progress` and fills its slot
streams the fill's reports as chunks of its API before its answer; a failure after that is the
stream's last event; a turn with no fill is answered as without it; a client that leaves ends the
turn. (Through `slotkeeper serve` with real processes: tests/gateway/test_prompt_progress.py.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from engine_pool.errors import Unavailable
from engine_pool.protocol.node import FillProgress, FillResult
from gateway.turn.engine_call import CHAT_PATH
from gateway.turn.restore_progress import RestoreProgress, wanted
from gateway.turn.slot_choice import Placement, Serve

RESTORE = Placement("n1-e0", 0, Serve.RESTORE)


async def _body(response: Response) -> list[dict[str, Any]]:
    assert isinstance(response, StreamingResponse)
    raw = b"".join(
        [part if isinstance(part, bytes) else part.encode() async for part in response.body_iterator]
    )
    return [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e.startswith("data: {")]


def _answer(ended: list[str]) -> StreamingResponse:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
        yield b"data: [DONE]\n\n"

    return StreamingResponse(chunks(), background=BackgroundTask(ended.append, "answered"))


def test_only_a_passed_through_stream_asking_for_progress_wants_it() -> None:
    assert wanted({"stream": True, "return_progress": True}, passthrough=True)
    assert not wanted({"stream": True, "return_progress": True}, passthrough=False)  # Responses, Messages
    assert not wanted({"stream": False, "return_progress": True}, passthrough=True)
    assert not wanted({"stream": True, "return_progress": "yes"}, passthrough=True)
    assert not wanted({"stream": True}, passthrough=True)


async def test_a_turn_without_a_fill_is_answered_as_it_answers() -> None:
    watcher = RestoreProgress(CHAT_PATH, "m")
    answer = _answer([])

    async def turn() -> Response:
        return answer

    assert await watcher.respond(turn()) is answer


async def test_a_fill_s_reports_come_first_then_the_answer() -> None:
    watcher, ended = RestoreProgress(CHAT_PATH, "m"), []

    async def turn() -> Response:
        report = watcher.filling("s1", RESTORE, None)
        report(FillProgress("fetching", 0, 600, 1.0))
        await asyncio.sleep(0)
        report(FillProgress("fetching", 600, 600, 20.0))
        report(FillProgress("restoring", 600, 600, 21.0))
        watcher.filled(FillResult(42, 600, "store", 30.5))
        return _answer(ended)

    response = await watcher.respond(turn())
    assert response.headers["x-session-id"] == "s1" and response.headers["x-slotkeeper-cache"] == "restored"
    chunks = await _body(response)
    progress = [c["restore_progress"] for c in chunks if "restore_progress" in c]
    assert [(p["stage"], p["bytes"], p["total"]) for p in progress] == [
        ("fetching", 0, 600),
        ("fetching", 600, 600),
        ("restoring", 600, 600),
        ("restored", 600, 600),
    ]
    assert progress[-1]["tokens"] == 42 and progress[-1]["time_ms"] == 30
    assert all(
        c["object"] == "chat.completion.chunk" and c["choices"] == [] and c["model"] == "m"
        for c in chunks[:4]
    )
    assert len({c["id"] for c in chunks[:4]}) == 1
    assert chunks[4] == {"choices": [{"delta": {"content": "hi"}}]}  # the answer, as it came
    assert ended == ["answered"]


async def test_a_fill_that_did_not_take_says_so_and_the_turn_goes_on() -> None:
    watcher = RestoreProgress("/v1/completions", "m")

    async def turn() -> Response:
        watcher.filling("s1", RESTORE, None)(FillProgress("fetching", 0, 600, 1.0))
        watcher.filled(None)
        return _answer([])

    chunks = await _body(await watcher.respond(turn()))
    assert [c["restore_progress"]["stage"] for c in chunks if "restore_progress" in c] == [
        "fetching",
        "failed",
    ]
    assert chunks[0]["object"] == "text_completion"


async def test_a_failure_after_the_first_report_is_the_stream_s_last_event() -> None:
    watcher = RestoreProgress(CHAT_PATH, "m")

    async def turn() -> Response:
        watcher.filling("s1", RESTORE, None)(FillProgress("fetching", 0, 600, 1.0))
        await asyncio.sleep(0)
        raise Unavailable("could not prepare the slot: the store is down", retry_after=1)

    response = await watcher.respond(turn())
    assert response.status_code == 200
    chunks = await _body(response)
    assert chunks[0]["restore_progress"]["stage"] == "fetching"
    assert chunks[-1]["error"]["message"] == "could not prepare the slot: the store is down"


async def test_a_client_that_leaves_during_the_fill_cancels_the_turn() -> None:
    watcher = RestoreProgress(CHAT_PATH, "m")
    cancelled = asyncio.Event()

    async def turn() -> Response:
        watcher.filling("s1", RESTORE, None)(FillProgress("fetching", 0, 600, 1.0))
        try:
            await asyncio.Event().wait()  # the fill goes on
        except asyncio.CancelledError:
            cancelled.set()
            raise
        raise AssertionError("not reached")

    response = await watcher.respond(turn())
    assert isinstance(response, StreamingResponse)
    body = response.body_iterator
    assert isinstance(body, AsyncIterator)
    await body.__anext__()  # the first report went out; then the client went away
    await body.aclose()  # type: ignore[attr-defined]
    assert cancelled.is_set()


async def test_a_client_that_leaves_as_the_answer_comes_still_ends_the_turn() -> None:
    watcher, ended = RestoreProgress(CHAT_PATH, "m"), []
    go, answering = asyncio.Event(), asyncio.Event()

    async def turn() -> Response:
        watcher.filling("s1", RESTORE, None)(FillProgress("fetching", 0, 600, 1.0))
        await go.wait()
        answering.set()  # (in the step that returns: the turn has answered once this is seen)
        return _answer(ended)

    response = await watcher.respond(turn())
    body = response.body_iterator  # type: ignore[attr-defined]
    await body.__anext__()
    go.set()
    await answering.wait()
    await body.aclose()
    assert ended == ["answered"]  # its bookkeeping ran although its body never did

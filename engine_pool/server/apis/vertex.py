"""Vertex AI's prediction route (llama-server's GCP compatibility): `POST /predict`.

Served only when the engine runs as a Vertex AI custom container (`AIP_MODE=PREDICTION`, read by
`settings.py`; `AIP_PREDICT_ROUTE` names the route, `AIP_HTTP_PORT` the port). The body is
`{"instances": [...], "parameters": {...}}`; each instance is a chat completions body tagged
`"@requestFormat": "chatCompletions"`, run on the one chat path concurrently (each needs a slot or
a queue place, as `n` choices do), and the answer is `{"predictions": [chat completion, ...]}` in
the instances' order. Vertex's predict call has no stream, so `stream` is refused; so is any other
request format. One failing instance fails the request (the others are cancelled), its error naming
the instance (`instances[1].messages`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine_pool.errors import ApiError, BadRequest
from engine_pool.http.body import Body, json_type, read_json

from ...protocol.bounds import check_count
from ...protocol.engine_answers import ChatCompletion
from ..chat_pipeline import run_chat
from ..route_context import limits

FORMAT_FIELD = "@requestFormat"
FORMATS = ("chatCompletions",)


def chat_bodies(body: Body, max_instances: int) -> list[dict[str, Any]]:
    """The chat completions body of each instance, validated. Pure."""
    instances = body.get_list("instances")
    if not instances:
        raise BadRequest("'instances' must be a non-empty array of prediction instances", param="instances")
    check_count("instances", instances, max_instances, "instances")
    out = []
    for i, instance in enumerate(instances):
        where = f"instances[{i}]"
        if not isinstance(instance, dict):
            raise BadRequest(f"'{where}' must be an object, got {json_type(instance)}", param=where)
        kind = instance.get(FORMAT_FIELD)
        if kind not in FORMATS:
            raise BadRequest(
                f"'{where}.{FORMAT_FIELD}' must be one of {', '.join(FORMATS)}, got {kind!r}",
                param=f"{where}.{FORMAT_FIELD}",
            )
        if instance.get("stream"):
            raise BadRequest(
                f"'{where}.stream': the predict route answers once; use /v1/chat/completions to stream",
                param=f"{where}.stream",
            )
        out.append({k: v for k, v in instance.items() if k != FORMAT_FIELD})
    return out


async def _predict_one(request: Request, chat: dict[str, Any], where: str) -> ChatCompletion:
    try:
        result = await run_chat(request, Body(chat))
    except ApiError as err:
        if err.param is not None:
            err.param = f"{where}.{err.param}"
        raise
    assert isinstance(result, dict)  # `stream` was refused above
    return result


async def predict(request: Request) -> Response:
    lim = limits(request)
    body = await read_json(request, lim.body)
    chats = chat_bodies(body, lim.max_generations)
    tasks = [asyncio.create_task(_predict_one(request, c, f"instances[{i}]")) for i, c in enumerate(chats)]
    try:
        predictions = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return JSONResponse({"predictions": predictions})


def routes(predict_route: str | None) -> list[Route]:
    """The predict route when the engine runs as a Vertex AI container (`predict_route` set)."""
    return [Route(predict_route, predict, methods=["POST"])] if predict_route else []

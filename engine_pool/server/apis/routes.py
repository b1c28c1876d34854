"""The engine's Responses and Messages endpoints: translate, run the chat path, translate back.

Stateless like llama-server's: `POST /v1/responses` accepts `store` but keeps nothing, so a
`previous_response_id` — and reading or deleting a response — is a 404 saying so (the gateway keeps
responses). It keeps no key either: reasoning comes back as text (`content`) only, and a reasoning
item sent with an `encrypted_content` (which only the gateway that sealed it can open) is a 400.
Hosted tools are left out of the prompt, as the gateway's default does, and said so: the answer's
`slotkeeper.omitted_tools`, its `X-Slotkeeper-Omitted-Tools` header and a log line.

`POST /v1/messages` serves Anthropic's Messages API; `/v1/messages/count_tokens` renders and
tokenizes the conversation exactly as a generation would. Errors leave in each API's
own shape (the app's handler picks it from the path, `errors.error_style`); a chat-path complaint
about a field the client did not send by that name is renamed to the field it did send.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing
from typing import Any, Protocol

import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine_pool.errors import ApiError, BadRequest, NotFound
from engine_pool.http.body import Body

from ...protocol import anthropic_messages, openai_responses
from ...protocol.engine_answers import ChatChunk, ChatCompletion
from ...protocol.field_names import MESSAGES_FIELDS, RESPONSES_FIELDS, renamed
from ...protocol.sse import NamedEvent, start_event_stream
from ..chat_pipeline import run_chat
from ..chat_request import parse_chat
from ..route_context import aliased, limits_and_body, runtime

log = structlog.get_logger("engine.responses")

NO_STORE = (
    "this engine keeps no responses (store is accepted, nothing is stored): "
    "the Slotkeeper gateway keeps them and serves {what}"
)


class EventTranslator(Protocol):
    def feed(self, chunk: ChatChunk) -> list[NamedEvent]: ...
    def finish(self) -> list[NamedEvent]: ...
    def failed(self, err: ApiError) -> list[NamedEvent]: ...


async def _chat(
    request: Request, chat: dict[str, Any], fields: Mapping[str, str], *, empty_ok: bool = False
) -> ChatCompletion | AsyncGenerator[ChatChunk, None]:
    try:
        return await run_chat(request, Body(chat), empty_ok=empty_ok)
    except BadRequest as err:
        raise renamed(err, fields) from None


async def _events(
    chunks: AsyncGenerator[ChatChunk, None], translator: EventTranslator
) -> AsyncGenerator[NamedEvent, None]:
    async with aclosing(chunks) as items:
        async for chunk in items:
            for ev in translator.feed(chunk):
                yield ev
    for ev in translator.finish():
        yield ev


# -- Responses ----------------------------------------------------------------------------------
async def create_response(request: Request) -> Response:
    lim, body = await limits_and_body(request)
    req = openai_responses.parse_request(body.data, max_items=lim.max_messages)
    if req.previous_response_id:
        raise NotFound(
            f"response {req.previous_response_id!r} not found: "
            + NO_STORE.format(what="'previous_response_id'"),
            param="previous_response_id",
        )
    req = openai_responses.with_reasoning_opened(req, _no_key)
    if req.tools.omitted:
        log.info("responses.tools_omitted", tools=[o.report() for o in req.tools.omitted])
    result = await _chat(request, openai_responses.chat_body(req, []), RESPONSES_FIELDS)
    response_id, created_at = "resp_" + secrets.token_hex(24), int(time.time())
    headers = openai_responses.omitted_header(req)
    if isinstance(result, dict):
        answer = openai_responses.response_object(req, result, response_id=response_id, created_at=created_at)
        return JSONResponse(answer, headers=headers)
    stream = openai_responses.ResponseStream(req, response_id=response_id, created_at=created_at)
    response = await start_event_stream(_events(result, stream), failed=stream.failed)
    response.headers.update(headers)
    return response


def _no_key(sealed: str, where: str) -> str:
    raise BadRequest(
        f"'{where}': this engine keeps no key to open reasoning sealed by a Slotkeeper gateway (or "
        "anyone else); send the reasoning item with its text ('content') instead",
        param=where,
    )


async def stored_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    raise NotFound(
        f"response {response_id!r} not found: " + NO_STORE.format(what="stored responses"),
        param="response_id",
    )


# -- Messages -----------------------------------------------------------------------------------
async def create_message(request: Request) -> Response:
    lim, body = await limits_and_body(request)
    req = anthropic_messages.parse_request(body.data, max_messages=lim.max_messages)
    result = await _chat(request, anthropic_messages.chat_body(req), MESSAGES_FIELDS, empty_ok=True)
    message_id = "msg_" + secrets.token_hex(12)
    if isinstance(result, dict):
        return JSONResponse(anthropic_messages.message_object(req, result, message_id=message_id))
    stream = anthropic_messages.MessageStream(req, message_id=message_id)
    return await start_event_stream(_events(result, stream), failed=stream.failed)


async def count_tokens(request: Request) -> Response:
    """`{"input_tokens": n}`: the conversation rendered by the model's template (tools included)
    and tokenized, as the chat path does before generating."""
    rt = runtime(request)
    engine = rt.require()
    lim, body = await limits_and_body(request)
    req = anthropic_messages.parse_count_request(body.data, max_messages=lim.max_messages)
    try:
        chat = parse_chat(
            Body(anthropic_messages.chat_body(req)),
            rt.defaults,
            lim,
            n_vocab=engine.model.n_vocab,
            n_ctx=engine.n_ctx_slot,
            empty_ok=True,
        )
    except BadRequest as err:
        raise renamed(err, MESSAGES_FIELDS) from None
    prompt = await asyncio.to_thread(  # rendering and tokenizing: off the event loop, as in run_chat
        rt.template.prompt,
        lambda text, add_special: rt.tokenize(text, add_special),
        chat.messages,
        chat.tools or None,
        chat.template_kwargs,
    )
    return JSONResponse({"input_tokens": len(prompt.tokens)})


ROUTES = [
    *aliased(create_response, ["POST"], "/v1/responses", "/responses"),
    Route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"]),
    Route("/v1/responses/{response_id}/input_items", stored_response, methods=["GET"]),
    *aliased(create_message, ["POST"], "/v1/messages", "/messages"),
    *aliased(count_tokens, ["POST"], "/v1/messages/count_tokens", "/messages/count_tokens"),
]

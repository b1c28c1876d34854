"""The Anthropic Messages API on the gateway (`/v1/messages`, `/v1/messages/count_tokens`).

A Messages request is one chat turn on a session (gateway.turn.serving): its conversation, translated to
chat messages, is resolved like any chat conversation (`X-Session-Id`, else the digests of its
history), so an agent that resends its history lands on its session and the engine reuses the slot
state — reported as `usage.cache_read_input_tokens`. Keys are accepted as `x-api-key` (Anthropic's
header) or Bearer; errors leave in Anthropic's shape (engine_pool.errors.error_style).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine_pool.protocol import anthropic_messages as api
from engine_pool.protocol.field_names import MESSAGES_FIELDS
from engine_pool.protocol.sse import named_event
from gateway.requests import (
    check_messages,
    counted_if_refused,
    forward_stateless,
    json_body,
    served_model,
    stateless_request,
)
from gateway.turn.forward import client_events
from gateway.turn.parts import Turn
from gateway.turn.serving import serve_client_turn


@dataclass
class MessagesDialect:
    req: Any  # api.MessagesRequest
    message_id: str = field(default_factory=lambda: "msg_" + secrets.token_hex(12))

    async def answer(self, payload: Mapping[str, Any], turn: Turn) -> api.MessageObject:
        return api.message_object(self.req, payload, message_id=self.message_id)

    async def stream(self, chunks: AsyncIterator[Mapping[str, Any]], turn: Turn) -> AsyncIterator[bytes]:
        events = api.MessageStream(self.req, message_id=self.message_id)
        async for name, data in client_events(events, chunks):
            yield named_event(name, data)


async def create(request: Request) -> Response:
    async with counted_if_refused(request) as (svc, tenant):
        data = await json_body(request)
        req = api.parse_request(data, max_messages=svc.settings.max_messages)
        model = await served_model(svc, tenant, req.model)
        chat = api.chat_body(req)
        messages = check_messages(chat, svc.settings.max_messages)
    return await serve_client_turn(
        request, tenant, chat, model, messages, MessagesDialect(req), MESSAGES_FIELDS
    )


async def count_tokens(request: Request) -> Response:
    """Counted by an engine of the model (its template and tokenizer); no session is involved."""
    svc, data, model = await stateless_request(request)
    payload = await forward_stateless(svc, model, "/v1/messages/count_tokens", data)
    return JSONResponse({"input_tokens": int(payload.get("input_tokens", 0))})


ROUTES = [
    Route("/v1/messages", create, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]

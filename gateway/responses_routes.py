"""The OpenAI Responses API on the gateway, with durable `previous_response_id`.

A response is one chat turn on a session (gateway.turn.serving). When stored (`store`, the default), its
document (storage.blobs.stored_responses) keeps the session it ran on and the conversation up to its
output, so `previous_response_id` continues that conversation on that session from any replica, after any
restart: the engine gets the same rendered prefix and reuses the slot state (live, or restored from
its slot file), and `usage.input_tokens_details.cached_tokens` shows it. Another tenant's id, an
unknown one or one whose response was deleted is a 404.

A client that stores nothing (`store: false`; Codex) replays the whole conversation every turn.
Its reasoning items come back sealed for the tenant (`encrypted_content`, gateway.sealing) when it
asks for them, and are opened again when replayed, so the prompt is the one its turn rendered.
Hosted tools are left out of the prompt or refused, as the tenant's `hosted_tools` says; left out,
they are named in the answer (`slotkeeper.omitted_tools`, `X-Slotkeeper-Omitted-Tools`), a log
line (`responses.tools_omitted`) and `slotkeeper_gateway_hosted_tools_omitted_total`. Codex's
`client_metadata` thread and session ids are session signals (gateway.turn.signals).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine_pool.errors import BadRequest, ServerError
from engine_pool.protocol import openai_responses as api
from engine_pool.protocol.field_names import RESPONSES_FIELDS
from engine_pool.protocol.sse import named_event
from gateway.requests import check_messages, counted_if_refused, json_body, served_model, tenant_of
from gateway.services import Services
from gateway.tenants import Tenant
from gateway.turn.forward import client_events
from gateway.turn.parts import Turn
from gateway.turn.serving import serve_client_turn
from gateway.turn.signals import SIGNALS
from storage.blobs.stored_responses import StoredResponse, new_response_id

log = structlog.get_logger("slotkeeper.gateway")

_MAX_LIST = 100
_FINAL = ("response.completed", "response.incomplete")  # the events that carry the final response
_UNSTORED = ServerError("the response could not be stored; retry")


@dataclass
class ResponsesDialect:
    """One Responses turn: the answer in the Responses shape, stored before it completes."""

    svc: Services
    tenant: Tenant
    req: Any  # api.ResponsesRequest
    model: str
    history: Sequence[Mapping[str, Any]]  # the conversation it continues (stored JSON, read back)
    response_id: str = field(default_factory=new_response_id)
    created_at: int = field(default_factory=lambda: int(time.time()))

    async def _store(self, response: Mapping[str, Any], turn: Turn) -> None:
        """Store `response` (the answer, or a stream's final event's) with the conversation so far."""
        if not self.req.store:
            return
        history = [*self.history, *api.input_messages(self.req), *api.output_messages(response)]
        stored = StoredResponse(
            self.response_id,
            self.tenant.name,
            turn.session,
            self.model,
            response,
            api.input_item_list(self.req),
            history,
        )
        await self.svc.responses.save(stored)

    def _seal(self, text: str) -> str:
        return self.svc.sealing.seal(self.tenant.name, text)

    async def answer(self, payload: Mapping[str, Any], turn: Turn) -> api.ResponseObject:
        response = api.response_object(
            self.req, payload, response_id=self.response_id, created_at=self.created_at, seal=self._seal
        )
        await self._store(response, turn)
        return response

    async def stream(self, chunks: AsyncIterator[Mapping[str, Any]], turn: Turn) -> AsyncIterator[bytes]:
        events = api.ResponseStream(
            self.req, response_id=self.response_id, created_at=self.created_at, seal=self._seal
        )
        async with contextlib.aclosing(client_events(events, chunks)) as translated:
            async for name, data in translated:  # (a failure's events are never final ones)
                if name in _FINAL and not await self._stored(data, turn):
                    for failed in events.failed(_UNSTORED):
                        yield named_event(*failed)
                    return
                yield named_event(name, data)

    async def _stored(self, event: dict[str, Any], turn: Turn) -> bool:
        """Store the final response of a stream before the client learns it is final, so that a
        continuation sent right after the event finds it. False (logged) when storing failed."""
        response = event.get("response")
        if not isinstance(response, dict):
            return True
        try:
            await self._store(response, turn)
        except Exception as exc:  # the client gets a failed response instead of a false success
            log.error("response.store_failed", response=self.response_id, error=str(exc))
            return False
        return True


async def create(request: Request) -> Response:
    async with counted_if_refused(request) as (svc, tenant):
        data = await json_body(request)
        req = api.parse_request(data, max_items=svc.settings.max_messages, hosted=tenant.hosted_tools.value)
        req = api.with_reasoning_opened(
            req, lambda sealed, where: svc.sealing.open(tenant.name, sealed, where)
        )
        _say_omitted(svc, tenant, req)
        model = await served_model(svc, tenant, req.model)
        history: Sequence[Mapping[str, Any]] = []
        session: tuple[str, str] | None = None
        if req.previous_response_id:
            previous = await svc.responses.load(tenant.name, req.previous_response_id)
            history = previous.history
            if previous.model == model:  # a session holds one model's state
                session = (previous.session, "previous_response")
        chat = api.chat_body(req, history)
        if isinstance(data.get("prompt_cache_key"), str):
            chat["prompt_cache_key"] = data["prompt_cache_key"]
        signals = {k: v for k, v in req.client_metadata.items() if k in _METADATA_SIGNALS}
        if signals:  # read by gateway.turn.signals (the engine ignores them)
            chat["client_metadata"] = signals
        messages = check_messages(chat, svc.settings.max_messages)
    dialect = ResponsesDialect(svc, tenant, req, model, history)
    response = await serve_client_turn(
        request, tenant, chat, model, messages, dialect, RESPONSES_FIELDS, session
    )
    response.headers.update(api.omitted_header(req))
    return response


# The `client_metadata` fields that are session signals (gateway.turn.signals.SIGNALS).
_METADATA_SIGNALS = frozenset(s.name for s in SIGNALS if s.where == "client_metadata")


def _say_omitted(svc: Services, tenant: Tenant, req: api.ResponsesRequest) -> None:
    """Hosted tools left out of the prompt: a log line and a count (the answer names them too)."""
    if not req.tools.omitted:
        return
    log.info("responses.tools_omitted", tenant=tenant.name, tools=[o.report() for o in req.tools.omitted])
    for omitted in req.tools.omitted:
        svc.metrics.hosted_tools_omitted.labels(omitted.type).inc()


async def detail(request: Request) -> Response:
    svc: Services = request.app.state.services
    tenant = tenant_of(request)
    response_id = request.path_params["response_id"]
    if request.method == "DELETE":
        await svc.responses.delete(tenant.name, response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
    stored = await svc.responses.load(tenant.name, response_id)
    return JSONResponse(stored.response)


async def input_items(request: Request) -> Response:
    svc: Services = request.app.state.services
    tenant = tenant_of(request)
    stored = await svc.responses.load(tenant.name, request.path_params["response_id"])
    items = list(stored.input_items)
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest("'order' must be 'asc' or 'desc'", param="order")
    if order == "desc":
        items.reverse()
    raw_limit = request.query_params.get("limit", "20")
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= _MAX_LIST:
        raise BadRequest(f"'limit' must be an integer within 1..{_MAX_LIST}", param="limit")
    after = request.query_params.get("after")
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise BadRequest(f"'after' names no input item of this response: {after!r}", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[: int(raw_limit)]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0].get("id") if page else None,
            "last_id": page[-1].get("id") if page else None,
            "has_more": len(items) > len(page),
        }
    )


ROUTES = [
    Route("/v1/responses", create, methods=["POST"]),
    Route("/v1/responses/{response_id}", detail, methods=["GET", "DELETE"]),
    Route("/v1/responses/{response_id}/input_items", input_items, methods=["GET"]),
]

"""What every route of the gateway does with a request before (or instead of) a turn: the tenant
its key names, its JSON body within the limits, the served model its name means, its place in the
tenant's rate window; and a request that involves no session, answered by any engine of the model."""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from starlette.requests import Request

from engine_pool.errors import (
    ApiError,
    BadRequest,
    NotFound,
    QuotaExceeded,
    Unauthorized,
    Unavailable,
)
from engine_pool.http.body import parse_json_object, read_body
from engine_pool.http.credentials import presented
from gateway.services import Services
from gateway.tenants import Tenant
from gateway.turn.engine_call import (
    forward_json,
)


def tenant_of(request: Request) -> Tenant:
    """The tenant of the key presented as `Authorization: Bearer KEY` or `x-api-key: KEY`."""
    svc: Services = request.app.state.services
    tenant = svc.tenants.authenticate(presented(request.headers) or None)
    if tenant is None:
        raise Unauthorized("a valid API key is required (Authorization: Bearer KEY or x-api-key: KEY)")
    return tenant


async def json_body(request: Request) -> dict[str, Any]:
    return (await raw_json_body(request))[1]


async def raw_json_body(request: Request) -> tuple[bytes, dict[str, Any]]:
    """The request's JSON object within the gateway's limits, and the bytes it was parsed from."""
    svc: Services = request.app.state.services
    limits = svc.settings.body_limits()
    raw = await read_body(request, limits)
    return raw, parse_json_object(raw, limits)


async def rate_limit(svc: Services, tenant: Tenant) -> None:
    """Requests per minute: one counter per tenant and minute, expiring with its window. A turn
    counts itself in its opening read (`TurnRunner.begin`); this is for everything else."""
    limit = tenant.quotas.requests_per_minute
    if limit is None:
        return
    count = await svc.index.incr_window(tenant.name, "rpm", 60)
    if count > limit:
        raise QuotaExceeded(
            f"tenant {tenant.name} exceeded {limit} requests per minute", retry_after=60 - time.time() % 60
        )


@contextlib.asynccontextmanager
async def counted_if_refused(request: Request) -> AsyncIterator[tuple[Services, Tenant]]:
    """Around a turn's validation, with the request's services and tenant: a request refused before
    its opening read (which counts it in the tenant's rate window) is counted here, so that every
    request counts once, malformed ones too (and a tenant over its rate gets 429 whatever else is
    wrong, as before validation)."""
    svc: Services = request.app.state.services
    tenant = tenant_of(request)
    try:
        yield svc, tenant
    except ApiError:
        await rate_limit(svc, tenant)
        raise


def check_messages(body: dict[str, Any], limit: int) -> list[dict[str, Any]]:
    """`messages` as a list of objects with a string role, at most `limit` of them (400 otherwise)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise BadRequest("'messages' must be a list", param="messages")
    if len(messages) > limit:
        raise BadRequest(f"'messages' has {len(messages)} messages; the limit is {limit}", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            where = f"messages[{i}]"
            raise BadRequest(f"'{where}' must be an object with a string 'role'", param=where)
    return messages


async def served_model(svc: Services, tenant: Tenant, requested: Any) -> str:
    """The served model id a requested name means for the tenant (404 unknown, 503 not ready)."""
    if not isinstance(requested, str) or not requested:
        raise BadRequest("'model' is required", param="model")
    model = tenant.model_id(requested, await svc.cluster.models())
    if model is None:  # an engine that registered since the cached listing was read?
        model = tenant.model_id(requested, await svc.cluster.models(fresh=True))
    if model is not None:
        return model
    configured = await svc.cluster.configured_models()
    if configured is not None and (name := tenant.model_id(requested, configured)) is not None:
        why = (await svc.cluster.failed_models()).get(name)
        if why is not None:  # its engines were given up: a retry cannot help until an operator acts
            raise Unavailable(f"the model {requested!r} failed to start: {why}", param="model")
    if configured is None or tenant.model_id(requested, configured) is not None:
        # A node runs it but no engine of it is ready (restarting after a crash, still loading), or a
        # node did not answer and it may be one of its models.
        raise Unavailable(f"the model {requested!r} is not ready; retry", retry_after=2, param="model")
    raise NotFound(f"the model {requested!r} does not exist", param="model")


async def stateless_request(request: Request) -> tuple[Services, dict[str, Any], str]:
    """The services, JSON body and served model of a request that involves no session (token
    counting); counted in the tenant's rate window here, as it has no opening read to count it."""
    svc: Services = request.app.state.services
    tenant = tenant_of(request)
    body = await json_body(request)
    await rate_limit(svc, tenant)
    return svc, body, await served_model(svc, tenant, body.get("model"))


async def forward_stateless(svc: Services, model: str, path: str, data: dict[str, Any]) -> Mapping[str, Any]:
    """A request that involves no session (token counting), answered by any ready engine of the model
    (its JSON as it came)."""
    engines = await svc.cluster.engines(model)
    if not engines:
        raise Unavailable(f"no engine of {model!r} is ready; retry", retry_after=2)
    engine = engines[secrets.randbelow(len(engines))]
    payload, _ = await forward_json(svc.engines, engine.url.rstrip("/") + path, {**data, "model": model})
    return payload

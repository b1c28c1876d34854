"""One turn's path through the gateway, for any of its APIs, step by step: its prompt's digests
(gateway.turn.prompt), its session resolved, opened, held and placed (gateway.turn.runner), its body
forwarded and the engine's answer passed on in the client's API (gateway.turn.forward).

Every API (Chat Completions, Completions, Responses, Anthropic Messages) is one chat turn on the
engines: a `Dialect` says how its request becomes the engine's chat body and how the engine's
answer (JSON or stream chunks) becomes that API's answer. Chat and completions pass through
unchanged (byte for byte when streamed). The session machinery — resolution, locks, placement,
restore, write-behind saves — is the same for all, so an Anthropic or Responses client resumes its
session without re-prefill exactly like a chat client.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from engine_pool.errors import BadRequest, Unavailable
from engine_pool.protocol.field_names import renamed
from engine_pool.protocol.volatile import apply_rules
from gateway.access_log import note
from gateway.services import Services
from gateway.tenants import Tenant
from gateway.turn import restore_progress
from gateway.turn.engine_call import CHAT_PATH, TurnOutcome
from gateway.turn.forward import Asked, Dialect, SlotChanged, answer, launch, unless_client_leaves
from gateway.turn.parts import Turn
from gateway.turn.prompt import Prompt
from gateway.turn.restore_progress import RestoreProgress


def normalised(
    svc: Services, tenant: Tenant, body: dict[str, Any], messages: list[dict[str, Any]], raw: bytes | None
) -> tuple[dict[str, Any], list[dict[str, Any]], bytes | None, list[str]]:
    """The request with the tenant's volatile-block rules applied (engine_pool.protocol.volatile):
    the same objects when none matched (the tenant's bytes are sent on), else new ones (encoded
    again), and the names of the rules that changed it (counted)."""
    if not tenant.volatile:
        return body, messages, raw, []
    changed, hits = apply_rules(messages, tenant.volatile)
    if not hits:
        return body, messages, raw, []
    for name in hits:
        svc.metrics.volatile_blocks.labels(name).inc()
    return {**body, "messages": changed}, changed, None, hits


async def serve_turn(
    request: Request,
    tenant: Tenant,
    body: dict[str, Any],
    model: str,
    messages: list[dict[str, Any]],
    path: str,
    *,
    dialect: Dialect | None = None,
    session: tuple[str, str] | None = None,
    raw: bytes | None = None,
) -> Response:
    """Admit, run and answer one turn. `body` is the engine's request body (chat completions, or
    completions when `path` says so), `raw` the tenant's bytes it was parsed from when it is theirs
    as it came (sent on without encoding it again); `session` is (id, how it was found) when the
    caller already knows it (a `previous_response_id`), else the usual resolution runs. The
    bookkeeping after the answer runs beside sending it. A turn whose slot changed hands while it
    was placed (`SlotChanged`) is placed once more. A stream asking for `return_progress` reports
    its restore's progress before its answer (gateway.turn.restore_progress)."""
    svc: Services = request.app.state.services
    note(request, tenant=tenant.name)
    body, messages, raw, rules = normalised(svc, tenant, body, messages, raw)
    # Its digests, computed once: for routing, branching, a restore cut at its checkpoint, bookkeeping.
    prompt = Prompt(messages, model, body, body.get("tools")) if path == CHAT_PATH else None
    asked = Asked(svc, tenant, body, model, messages, path, dialect, raw, rules, prompt)
    if not restore_progress.wanted(body, dialect is None):
        return await _serve(request, svc, asked, session, None)
    watcher = RestoreProgress(path, model)  # (its reports stream before the answer)
    return await watcher.respond(_serve(request, svc, asked, session, watcher))


async def _serve(
    request: Request,
    svc: Services,
    asked: Asked,
    session: tuple[str, str] | None,
    watcher: RestoreProgress | None,
) -> Response:
    tenant, body, model, prompt = asked.tenant, asked.body, asked.model, asked.prompt
    found = session
    # Placed again once when its slot changed hands meanwhile (a restore there is not checked then:
    # a node of the previous release labels no restore).
    for check_restore in (True, False):
        started = await svc.runner.start(
            tenant, request.headers, body, model, prompt, found, functools.partial(launch, asked), watcher
        )
        found, turn = started.found, started.turn
        if started.early is None and prompt is not None:  # (an early start runs on its live slot)
            turn = await _split(request, svc, asked, turn)
        own = check_restore and turn.forked_from is None  # a restore of its own state, labelled with it
        try:
            return await answer(request, asked, turn, started.early, own)
        except SlotChanged:  # its record placed it in a slot that holds another's state
            continue
    raise Unavailable("the session's slot changed hands while it was placed; retry", retry_after=1)


async def _split(request: Request, svc: Services, asked: Asked, turn: Turn) -> Turn:
    """The turn, prefilled on a prefill engine when its policy says so (gateway.turn.handoff); a
    client that leaves meanwhile cancels it (the node call closes, and the node cancels the prefill
    where it runs), and the turn still ends once."""
    try:
        body = asked.engine_json(turn.session, turn.placement)
        return await unless_client_leaves(request, svc.runner.handoffs.hand_off(turn, body, asked.prompt))
    except BaseException:
        svc.runner.finish_soon(turn, asked.messages, TurnOutcome(error="cancelled"))
        raise


async def serve_client_turn(
    request: Request,
    tenant: Tenant,
    chat: dict[str, Any],
    model: str,
    messages: list[dict[str, Any]],
    dialect: Dialect,
    fields: Mapping[str, str],
    session: tuple[str, str] | None = None,
) -> Response:
    """A client API's request (Messages, Responses) translated to `chat` and served as a chat turn
    answered in its `dialect`. The engine's chat path names its own fields in a 400: the client's
    names (`fields`, engine -> client) replace them."""
    try:
        return await serve_turn(
            request, tenant, chat, model, messages, CHAT_PATH, dialect=dialect, session=session
        )
    except BadRequest as err:
        raise renamed(err, fields) from None

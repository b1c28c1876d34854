"""Which client field a chat field came from, per API, so a chat-path complaint names what the client sent.

The Responses and Messages translations fill some chat fields from differently named fields of the
client's request (`max_output_tokens` becomes `max_tokens`). When the chat path refuses such a field,
the engine and the gateway both rename the error back with `renamed` and these tables, so the client
reads the name it used. Pure.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from engine_pool.errors import ApiError

# Chat fields the translations fill from a differently named field of the client's request.
RESPONSES_FIELDS = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}
MESSAGES_FIELDS = {"stop": "stop_sequences", "response_format": "output_config.format"}

_HEAD = re.compile(r"[A-Za-z_]+")


def renamed(err: ApiError, fields: Mapping[str, str]) -> ApiError:
    """`err` naming the client's field where it names a chat field `fields` maps (in place)."""
    head = _HEAD.match(err.param or "")
    if head is None or head.group() not in fields or err.param is None:
        return err
    old, new = head.group(), fields[head.group()]
    if old == "messages" and err.param != old:
        return err  # a message's index differs from the item's: leave the chat path's words
    err.param = new + err.param[len(old) :]
    err.message = err.message.replace(f"'{old}", f"'{new}")
    return err

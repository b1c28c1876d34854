"""The Anthropic Messages API (`/v1/messages`) as a translation onto chat completions. Pure.

request: `parse_request` / `parse_count_request` -> `MessagesRequest`, and `chat_body`; output:
Message objects; stream: `MessageStream` (chat chunks -> Messages events).
"""

from .output import MessageObject, message_object, usage_object
from .request import MessagesRequest, chat_body, parse_count_request, parse_request
from .stream import MessageStream

__all__ = [
    "MessageObject",
    "MessageStream",
    "MessagesRequest",
    "chat_body",
    "message_object",
    "parse_count_request",
    "parse_request",
    "usage_object",
]

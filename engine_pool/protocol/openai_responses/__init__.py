"""The OpenAI Responses API (`/v1/responses`) as a translation onto chat completions. Pure.

request: `parse_request` -> `ResponsesRequest`; items: input/output items <-> chat messages and the
chat body; output: Response objects; stream: `ResponseStream` (chat chunks -> Responses events).
"""

from .items import chat_body, input_item_list, input_messages, items_to_messages, output_messages
from .output import response_object, usage_object
from .request import ResponsesRequest, parse_request
from .stream import ResponseStream

__all__ = [
    "ResponseStream",
    "ResponsesRequest",
    "chat_body",
    "input_item_list",
    "input_messages",
    "items_to_messages",
    "output_messages",
    "parse_request",
    "response_object",
    "usage_object",
]

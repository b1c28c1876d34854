"""The OpenAI Responses API (`/v1/responses`) as a translation onto chat completions. Pure.

request: `parse_request` -> `ResponsesRequest`; tools: function, custom, namespace and hosted tools
and what the model sees of them; items: input/output items <-> chat messages and the chat body;
output: Response objects; stream: `ResponseStream` (chat chunks -> Responses events); objects: the
items, tools and Response they build, as types.
"""

from .items import chat_body, input_item_list, input_messages, items_to_messages, output_messages
from .objects import ResponseObject
from .output import OMITTED_HEADER, omitted_header, response_object, usage_object
from .request import ResponsesRequest, parse_request, with_reasoning_opened
from .stream import ResponseStream
from .tools import HOSTED, HOSTED_POLICIES

__all__ = [
    "HOSTED",
    "HOSTED_POLICIES",
    "OMITTED_HEADER",
    "ResponseObject",
    "ResponseStream",
    "ResponsesRequest",
    "chat_body",
    "input_item_list",
    "input_messages",
    "items_to_messages",
    "omitted_header",
    "output_messages",
    "parse_request",
    "response_object",
    "usage_object",
    "with_reasoning_opened",
]

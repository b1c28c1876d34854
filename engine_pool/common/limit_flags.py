"""The request limits that both the gateway's edge and every engine enforce: one row each.

A limit the two processes share has one default and one check, here; each command words its own help
line (`Flag.with_help`), so `slotkeeper gateway --help` and `slotkeeper engine --help` may describe the
same limit for their own readers without the numbers drifting apart. `body.BodyLimits` takes its
defaults from these rows too.
"""

from __future__ import annotations

from .flags import Flag, above, at_least, parse_bytes, parse_int, within

MAX_BODY_BYTES = Flag(
    "max_body_bytes",
    ("--max-body-bytes",),
    parse_bytes,
    "largest request body; larger ones get 413",
    default=16 << 20,
    check=at_least(1024),
)
MAX_JSON_DEPTH = Flag(
    "max_json_depth",
    ("--max-json-depth",),
    parse_int,
    "deepest JSON nesting of a request body",
    default=64,
    check=within(4, 512),
)
BODY_TIMEOUT_S = Flag(
    "body_timeout_s",
    ("--body-timeout-s",),
    float,
    "seconds a client may take to send its request body; slower ones get 408",
    default=60.0,
    check=above(0),
)
MAX_MESSAGES = Flag(
    "max_messages",
    ("--max-messages",),
    parse_int,
    "messages per request",
    default=4096,
    check=at_least(1),
)

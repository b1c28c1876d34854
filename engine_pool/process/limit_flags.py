"""The request limits that both the gateway's edge and every engine enforce: one row each.

A limit the two processes share has one default and one check, here; each command words its own help
line (`Flag.with_help`), so `slotkeeper gateway --help` and `slotkeeper engine --help` may describe the
same limit for their own readers without the numbers drifting apart. `body.BodyLimits` takes its
defaults from these rows too.
"""

from __future__ import annotations

from .flags import above, at_least, bytes_flag, float_flag, int_flag, within

MAX_BODY_BYTES = bytes_flag(
    "max_body_bytes",
    "--max-body-bytes",
    16 << 20,
    "largest request body; larger ones get 413",
    at_least(1024),
)
MAX_JSON_DEPTH = int_flag(
    "max_json_depth", "--max-json-depth", 64, "deepest JSON nesting of a request body", within(4, 512)
)
BODY_TIMEOUT_S = float_flag(
    "body_timeout_s",
    "--body-timeout-s",
    60.0,
    "seconds a client may take to send its request body; slower ones get 408",
    above(0),
)
MAX_MESSAGES = int_flag("max_messages", "--max-messages", 4096, "messages per request", at_least(1))

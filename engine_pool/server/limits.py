"""What one request may ask of the engine: the bounds, built once from settings, and their checks.

Every list and every string a client controls is bounded, so that no tenant can make the engine
parse, render, tokenize or compile without limit — on the event loop, on the decode loop, or in
llama.cpp's recursive grammar parser. Each limit is a setting (engine_flags.FLAGS) and each refusal is
a 400 (413/408 for the body itself) whose message names the field, what it holds and the limit,
with `extra.limit` for programs. `RequestLimits` is built once by the app (`from_settings`) and
read by every route; the checks are pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import native
from engine_pool.errors import BadRequest
from engine_pool.http.body import BodyLimits

from ..protocol.bounds import too_many
from .grammar import GrammarLimits
from .settings import EngineSettings


@dataclass(frozen=True)
class RequestLimits:
    """The engine's bounds on one request (defaults: EngineSettings', i.e. its FLAGS rows')."""

    body: BodyLimits = field(default_factory=BodyLimits)
    n_slots: int = EngineSettings.n_slots
    queue_size: int = EngineSettings.queue_size
    max_messages: int = EngineSettings.max_messages
    max_tools: int = EngineSettings.max_tools
    max_text_chars: int = EngineSettings.max_text_chars
    max_stop: int = EngineSettings.max_stop
    max_stop_chars: int = EngineSettings.max_stop_chars
    max_logit_bias: int = EngineSettings.max_logit_bias
    max_grammar_bytes: int = EngineSettings.max_grammar_bytes
    max_grammar_depth: int = EngineSettings.max_grammar_depth
    schema: GrammarLimits = field(default_factory=GrammarLimits)
    # Not settings (yet): fixed bounds on fields whose cost grows per generated token.
    max_n_probs: int = native.MAX_N_PROBS  # `n_probs`, `top_logprobs`, `logprobs`: the core's bound
    max_response_fields: int = 64  # `response_fields` paths

    @classmethod
    def from_settings(cls, s: EngineSettings) -> RequestLimits:
        return cls(
            body=BodyLimits(s.max_body_bytes, s.max_json_depth, s.body_timeout_s),
            n_slots=s.n_slots,
            queue_size=s.queue_size,
            max_messages=s.max_messages,
            max_tools=s.max_tools,
            max_text_chars=s.max_text_chars,
            max_stop=s.max_stop,
            max_stop_chars=s.max_stop_chars,
            max_logit_bias=s.max_logit_bias,
            max_grammar_bytes=s.max_grammar_bytes,
            max_grammar_depth=s.max_grammar_depth,
            schema=GrammarLimits(s.max_schema_depth, s.max_schema_grammar_bytes, s.max_schema_grammar_rules),
        )

    @property
    def max_prompts(self) -> int:
        """Prompts in one /v1/completions batch: each needs a slot or a queue place at once, so a
        larger batch could only ever end in 503s that a client would retry forever."""
        return self.n_slots + self.queue_size

    @property
    def max_generations(self) -> int:
        """Generations one request may start (`n` choices of each prompt): as `max_prompts`, each
        needs a slot or a queue place at once."""
        return self.max_prompts


def text_chars(value: Any) -> int:
    """Characters in every string value inside a decoded JSON value (keys are structure: the body's
    size bounds them). Iterative: depth is bounded already, but a walk should not depend on it."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def check_text(field: str, value: Any, limit: int) -> None:
    """The strings inside `value` hold at most `limit` characters together."""
    n = text_chars(value)
    if n > limit:
        raise too_many(field, n, limit, "characters of text")


def check_n_predict(field: str, n_tokens: int, n_ctx: int) -> None:
    """A token count a slot cannot hold (`max_tokens`, `n_predict`, `repeat_last_n`): llama-server
    clamps it silently; we refuse it, naming both numbers."""
    if n_tokens > n_ctx:
        raise BadRequest(
            f"'{field}' is {n_tokens}, more than a slot's context of {n_ctx} tokens "
            f"(prompt and completion share it)",
            param=field,
            extra={"n_ctx": n_ctx, "limit": n_ctx},
        )

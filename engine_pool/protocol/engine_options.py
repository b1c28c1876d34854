"""llama-server options a Responses or Messages request may carry beyond its own API.

The API conventions ask to pass engine extras through rather than reject them: a Responses or
Messages body may hold llama-server's sampling and slot options (`seed`, `min_p`, `id_slot`,
`chat_template_kwargs`, ...). They go into the chat body unchanged, where the chat path validates
and bounds them exactly as on /v1/chat/completions. Only the names below travel: anything else an
API does not define is ignored, since the chat path would read it with chat semantics.
"""

from __future__ import annotations

from collections.abc import Mapping

# Field -> the APIs that pass it (a field the API defines itself is translated, never passed).
PASSED: dict[str, frozenset[str]] = {
    "seed": frozenset({"responses", "messages"}),
    "top_k": frozenset({"responses"}),  # Messages defines top_k
    "min_p": frozenset({"responses", "messages"}),
    "repeat_penalty": frozenset({"responses", "messages"}),
    "repeat_last_n": frozenset({"responses", "messages"}),
    "presence_penalty": frozenset({"responses", "messages"}),
    "frequency_penalty": frozenset({"responses", "messages"}),
    "logit_bias": frozenset({"responses", "messages"}),
    "ignore_eos": frozenset({"responses", "messages"}),
    "cache_prompt": frozenset({"responses", "messages"}),
    "id_slot": frozenset({"responses", "messages"}),
    "stop": frozenset({"responses"}),  # Messages has stop_sequences
    "chat_template_kwargs": frozenset({"responses", "messages"}),
    # llama-server's stream telemetry: a Responses stream reports the prompt's progress as
    # `response.in_progress` events and puts `timings` on its text deltas; a Messages stream shows
    # neither, as llama-server's.
    "return_progress": frozenset({"responses", "messages"}),
    "timings_per_token": frozenset({"responses"}),
}


def engine_options(data: Mapping[str, object], api: str) -> Mapping[str, object]:
    """The pass-through fields `data` holds, for `api` ("responses" or "messages"); nulls are absent.
    Their values are the client's JSON, unread here (the chat path checks them)."""
    return {k: data[k] for k, apis in PASSED.items() if api in apis and data.get(k) is not None}


def merge_template_kwargs(
    options: Mapping[str, object], kwargs: Mapping[str, object]
) -> Mapping[str, object]:
    """`options` with `kwargs` added to its `chat_template_kwargs` (the API's own setting wins over a
    passed-through one; a passed value that is not an object is left for the chat path to refuse)."""
    if not kwargs:
        return options
    passed = options.get("chat_template_kwargs")
    if passed is not None and not isinstance(passed, dict):
        return options
    return {**options, "chat_template_kwargs": {**(passed or {}), **kwargs}}

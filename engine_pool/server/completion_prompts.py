"""The prompts of `/completion` and `/v1/completions`: llama-server's forms, their bounds, tokenizing.

A prompt is text, token ids, llama-server's mix of both, or `{"prompt_string": ...}`; an array that
holds no token id at its top level is several prompts. Every prompt is bounded (`check_prompts`)
before anything tokenizes it, and tokenized (`completion_prompt`) in a worker thread.
"""

from __future__ import annotations

from typing import Any

from engine_pool.errors import BadRequest, ContextSizeExceeded
from engine_pool.http.body import check_tokens, json_type

from ..protocol.bounds import too_many
from .limits import RequestLimits, check_text
from .runtime import Runtime


def split_prompts(value: Any) -> list[Any]:
    """llama-server's prompt forms: an array that holds no token id at its top level is several
    prompts (strings, arrays of token ids, mixes, `{"prompt_string": ...}` objects); anything else
    is one prompt."""
    if isinstance(value, list) and not any(_is_id(v) for v in value):
        if not value:
            raise BadRequest("'prompt' must not be empty", param="prompt")
        return list(value)
    return [value]


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_prompts(value: Any, lim: RequestLimits, n_ctx: int, n: int = 1) -> list[Any]:
    """The prompts `value` holds (`split_prompts`), bounded before anything tokenizes them: their
    number (times `n` choices each) against what the engine can run at once, their text against
    --max-text-chars, each one's token ids against a slot's context."""
    prompts = split_prompts(value)
    check_text("prompt", value, lim.max_text_chars)
    if len(prompts) * n > lim.max_generations:
        if n == 1:
            raise too_many(
                "prompt", len(prompts), lim.max_generations, "prompts (at most one per slot and queue place)"
            )
        raise too_many(
            "prompt",
            len(prompts) * n,
            lim.max_generations,
            f"generations at {n} choices a prompt (one per slot and queue place)",
        )
    for i, p in enumerate(prompts):
        check_prompt(p, lim, n_ctx, prompt_field(prompts, i))
    return prompts


def prompt_field(prompts: list[Any], i: int) -> str:
    return "prompt" if len(prompts) == 1 else f"prompt[{i}]"


def completion_prompt(rt: Runtime, value: Any, where: str = "prompt") -> list[int]:
    """One prompt: text, token ids, llama-server's mix of both (text pieces are tokenized in place),
    or `{"prompt_string": text or mix}` (with `multimodal_data`: refused, no model here reads media).

    Routes check its size first (`check_prompts`) and run this in a worker thread: tokenizing takes
    time in proportion to the text. (The native tokenizer still holds the GIL, so for now the
    loop waits all the same; the bound is what keeps that short.)"""
    n_vocab = rt.require().model.n_vocab
    if isinstance(value, dict):
        if value.get("multimodal_data") is not None:
            raise BadRequest(
                f"'{where}.multimodal_data': this engine serves a text-only model; multimodal prompts "
                "are not supported",
                param=f"{where}.multimodal_data",
            )
        if "prompt_string" not in value:
            raise BadRequest(
                f"'{where}' must be a string, token ids or an object with 'prompt_string'; "
                "this object has none",
                param=where,
            )
        value, where = value["prompt_string"], f"{where}.prompt_string"
    if isinstance(value, str):
        tokens = rt.tokenize(value, True)
    elif isinstance(value, list) and all(isinstance(v, str) or _is_id(v) for v in value):
        tokens = []
        for i, v in enumerate(value):
            tokens += (
                rt.tokenize(v, i == 0) if isinstance(v, str) else check_tokens([v], n_vocab, f"{where}[{i}]")
            )
    else:
        raise BadRequest(
            f"'{where}' must be a string, an array of token ids, a mix of both, or an object with "
            f"'prompt_string'; got {json_type(value)}",
            param=where,
        )
    if not tokens:
        raise BadRequest(f"'{where}' is empty", param=where)
    return tokens


def check_prompt(value: Any, lim: RequestLimits, n_ctx: int, where: str = "prompt") -> None:
    """Bound one prompt before anything tokenizes it: its text against --max-text-chars, its token
    ids against a slot's context (every id is one token)."""
    check_text(where, value, lim.max_text_chars)
    if isinstance(value, dict):
        value = value.get("prompt_string")
    if isinstance(value, list):
        n_ids = sum(1 for v in value if _is_id(v))
        if n_ids >= n_ctx:
            raise ContextSizeExceeded(n_ids, n_ctx)

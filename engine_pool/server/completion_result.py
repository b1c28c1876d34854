"""llama-server's `/completion` result: the object, the fields a request may cut it down to, and
`__verbose` (the same object, which the chat and OpenAI completion answers carry when asked for).
"""

from __future__ import annotations

from typing import Any

import native
from engine_pool.http.body import Body

from ..protocol.bounds import check_count
from ..protocol.engine_answers import LlamaCompletion
from .decoding import Outcome, TokenBytes, probs_json
from .limits import RequestLimits
from .runtime import Runtime
from .sampling import Sampling, generation_settings


def response_fields(body: Body, lim: RequestLimits) -> list[str]:
    """llama-server's `response_fields`: the paths (`a/b` reaches into objects) a /completion
    result is cut down to."""
    fields = body.get_str_list("response_fields")
    check_count("response_fields", fields, lim.max_response_fields, "paths")
    return list(fields)


def select_fields(result: LlamaCompletion, paths: list[str]) -> dict[str, Any]:
    """`result` cut down to `paths`, each kept under its own name (`generation_settings/n_predict`
    becomes a top-level key of that name); a path that leads nowhere is left out, as llama-server does."""
    out: dict[str, Any] = {}
    for path in paths:
        value: Any = result
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


def completion_result(
    rt: Runtime,
    o: Outcome,
    sampling: Sampling,
    pieces: TokenBytes,
    prompt: str,
    *,
    streamed: bool,
    index: int = 0,
) -> LlamaCompletion:
    """The whole result, or (streamed) the last chunk: everything but the text, tokens and
    probabilities already sent (`select_fields` cuts it down to the request's `response_fields`)."""
    result: LlamaCompletion = {
        "index": index,
        "content": "" if streamed else o.text,
        "tokens": [] if streamed else o.tokens,
        "id_slot": o.slot,
        "stop": True,
        "model": rt.settings.model_id,
        "tokens_predicted": o.n_predicted,
        "tokens_evaluated": o.n_prompt,
        "generation_settings": generation_settings(sampling),
        "prompt": prompt,
        "has_new_line": "\n" in o.text,
        "truncated": False,
        "stop_type": o.stop_type,
        "stopping_word": o.stopping_word,
        "tokens_cached": o.n_prompt + max(o.n_predicted - 1, 0),
        "timings": o.timings,
        "slotkeeper": o.reuse,
    }
    if o.probs and not streamed:
        result["completion_probabilities"] = probs_json(o.probs, pieces)
    return result


def prompt_text(engine: native.Engine, tokens: list[int]) -> str:
    """llama-server's `prompt` of a result: the prompt's tokens as text, special tokens spelled out.
    Client-sized: call it in a worker thread."""
    return engine.detokenize(tokens, False, True)


def verbose_result(
    rt: Runtime, o: Outcome, sampling: Sampling, prompt: str, pieces: TokenBytes
) -> LlamaCompletion:
    """llama-server's `__verbose` (a response's debug field with `verbose` or `-v`): the generation
    as /completion reports it, the prompt's text included."""
    return completion_result(rt, o, sampling, pieces, prompt, streamed=False)

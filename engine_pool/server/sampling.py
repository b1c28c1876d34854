"""Sampling and slot options of a decode request, read from llama-server or OpenAI field names.

`FIELDS` is the one table from request fields (with their aliases across the two dialects) to
`Sampling` attributes; `read_sampling` applies it to a body, `to_native` turns the result into
the core's RequestParams.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import native
from engine_pool.errors import BadRequest
from engine_pool.http.body import Body, json_type

from ..protocol.bounds import check_count, too_many
from .grammar import GrammarTriggers
from .limits import RequestLimits, check_n_predict


@dataclass(frozen=True)
class Sampling:
    """What one request asks of the sampler and of its slot."""

    n_predict: int = -1
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = -1
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    cache_prompt: bool = True
    id_slot: int = -1
    # Other slots the prompt may start from when they hold more of it (a shared system prompt, a
    # parent conversation): None = every slot (llama-server's single-tenant view); the gateway
    # always names them (one tenant's slots), so no tenant reaches another's state.
    prefix_slots: tuple[int, ...] | None = None
    slot_owner: str = ""  # who it runs for: its slot takes it, and it starts only from slots of it
    slot_session: str = ""  # the session it runs for (the gateway's): the slot's label (SlotLeases)
    slot_expect: str = ""  # the session the slot must hold already (its label), else 409 SlotChanged
    stop: tuple[str, ...] = ()
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Biases keyed by text, applied to every token of the text's tokenization once it is tokenized
    # (`resolve_text_bias`, in a worker thread: the keys are client-sized text).
    logit_bias_text: tuple[tuple[str, float], ...] = ()
    n_probs: int = 0  # alternatives reported per generated token (0: no probabilities)
    return_progress: bool = False  # a stream's prompt progress reports (llama-server's)
    timings_per_token: bool = False  # every streamed token with the timings so far (llama-server's)


@dataclass(frozen=True)
class FieldSpec:
    """Request field names (first present wins), the Sampling attribute, the kind and the bounds."""

    names: tuple[str, ...]
    attr: str
    kind: str  # int | float | bool
    lo: float | None = None
    hi: float | None = None


MAX_LABEL = 128  # characters of a slot label's owner or session
# The core's integers are C ints: a larger value would fail inside the binding (a 500), not here.
_INT32_MAX = 2**31 - 1

# The output limit's lowest value under each of its names: OpenAI's take a count of tokens (>= 1: a
# 0 or -1 there is a client's mistake, never "no limit"); llama-server's `n_predict` keeps its own
# meanings on the engine's API (-1: no limit, 0: evaluate the prompt only). A gateway that sets an
# output cap (`max_tokens_default`) makes every name >= 1: nothing a request says lifts the cap.
OUTPUT_LIMIT_LO = {"n_predict": -1, "max_completion_tokens": 1, "max_tokens": 1}
CAPPED_LO = 1

FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec(("n_predict", "max_completion_tokens", "max_tokens"), "n_predict", "int", -1, _INT32_MAX),
    FieldSpec(("temperature",), "temperature", "float", 0.0, 100.0),
    FieldSpec(("top_k",), "top_k", "int", 0, _INT32_MAX),
    FieldSpec(("top_p",), "top_p", "float", 0.0, 1.0),
    FieldSpec(("min_p",), "min_p", "float", 0.0, 1.0),
    FieldSpec(("seed",), "seed", "int", -1, 2**63 - 1),
    FieldSpec(("repeat_penalty",), "repeat_penalty", "float", 0.0),
    FieldSpec(("repeat_last_n",), "repeat_last_n", "int", -1, _INT32_MAX),
    FieldSpec(("presence_penalty",), "presence_penalty", "float", -2.0, 2.0),
    FieldSpec(("frequency_penalty",), "frequency_penalty", "float", -2.0, 2.0),
    FieldSpec(("ignore_eos",), "ignore_eos", "bool"),
    FieldSpec(("cache_prompt",), "cache_prompt", "bool"),
    FieldSpec(("id_slot", "slot_id"), "id_slot", "int", -1, _INT32_MAX),
)


def read_label(body: Body, name: str) -> str:
    """A slot-label field (`slot_owner`, `slot_session`, `slot_expect`: the gateway's names for a
    slot's tenant and session); '' when absent."""
    value = body.get_str(name, "") or ""
    if len(value) > MAX_LABEL:
        raise BadRequest(f"'{name}' has {len(value)} characters; the limit is {MAX_LABEL}", param=name)
    return value


def read_sampling(
    body: Body, defaults: Sampling, limits: RequestLimits, *, n_vocab: int, n_ctx: int
) -> Sampling:
    """The request's options over `defaults` (the engine's --temp, --seed, -n), within `limits` and
    a slot's context `n_ctx`."""
    values: dict[str, Any] = {}
    for spec in FIELDS:
        name = next((n for n in spec.names if body.has(n)), None)
        if name is None:
            continue
        if spec.attr == "n_predict":
            lo = CAPPED_LO if body.has("max_tokens_default") else OUTPUT_LIMIT_LO[name]
            values[spec.attr] = body.get_int(name, 0, lo=lo, hi=_int(spec.hi))
        elif spec.kind == "int":
            values[spec.attr] = body.get_int(name, 0, lo=_int(spec.lo), hi=_int(spec.hi))
        elif spec.kind == "float":
            values[spec.attr] = body.get_float(name, 0.0, lo=spec.lo, hi=spec.hi)
        else:
            values[spec.attr] = body.get_bool(name, False)
        if spec.attr in ("n_predict", "repeat_last_n"):
            # Neither means anything past a slot's context; llama.cpp would allocate the penalty
            # window (repeat_last_n) in full, on the event loop's thread.
            check_n_predict(name, values[spec.attr], n_ctx)
    if body.get_bool("post_sampling_probs", False):
        raise BadRequest(
            "'post_sampling_probs' is not supported by this engine: probabilities (n_probs) come from "
            "the raw logits, before the sampler chain",
            param="post_sampling_probs",
        )
    # Both only mean something in a stream, as in llama-server (a plain answer has its timings).
    stream = body.get_bool("stream", False)
    values["return_progress"] = body.get_bool("return_progress", False) and stream
    values["timings_per_token"] = body.get_bool("timings_per_token", False) and stream
    if "n_predict" not in values and body.has("max_tokens_default"):
        # The gateway's output cap for a request that set none (its tenant's); a cap past the slot's
        # context only means the context's end, where every decode run stops anyway.
        values["n_predict"] = body.get_int("max_tokens_default", -1, lo=1, hi=_INT32_MAX)
    values["n_probs"] = body.get_int("n_probs", defaults.n_probs, lo=0, hi=limits.max_n_probs)
    id_slot = values.get("id_slot", -1)
    n_slots = limits.n_slots
    if id_slot >= n_slots:
        raise BadRequest(
            f"'id_slot' {id_slot} does not exist (this engine has slots 0..{n_slots - 1})", param="id_slot"
        )
    values["prefix_slots"] = read_prefix_slots(body, n_slots)
    for name in ("slot_owner", "slot_session", "slot_expect"):
        values[name] = read_label(body, name)
    if values["slot_expect"] and (id_slot < 0 or not values["slot_owner"]):
        raise BadRequest("'slot_expect' needs 'id_slot' and 'slot_owner'", param="slot_expect")
    by_id, by_text = read_logit_bias(body, n_vocab, limits.max_logit_bias, limits.max_text_chars)
    return Sampling(
        **{
            **defaults.__dict__,
            **values,
            "stop": read_stop(body, limits),
            "logit_bias": by_id,
            "logit_bias_text": by_text,
        }
    )


def read_prefix_slots(body: Body, n_slots: int) -> tuple[int, ...] | None:
    """`prefix_slots`: distinct slot ids of this engine (None when absent: every slot)."""
    raw = body.get_list("prefix_slots")
    if raw is None:
        return None
    if len(raw) > n_slots:
        raise BadRequest(
            f"'prefix_slots' names {len(raw)} slots; this engine has {n_slots}", param="prefix_slots"
        )
    for i, v in enumerate(raw):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < n_slots:
            raise BadRequest(
                f"'prefix_slots[{i}]' must be a slot id within 0..{n_slots - 1}, got {v!r}"[:200],
                param="prefix_slots",
            )
    return tuple(dict.fromkeys(raw))


def _int(v: float | None) -> int | None:
    return None if v is None else int(v)


def read_stop(body: Body, limits: RequestLimits) -> tuple[str, ...]:
    """Stop strings: each is matched against every generated piece, so their number and length
    bound the per-token work on the event loop."""
    stop = tuple(body.get_str_list("stop"))
    check_count("stop", stop, limits.max_stop, "strings")
    for i, s in enumerate(stop):
        if not s:
            raise BadRequest("'stop' strings must not be empty", param="stop")
        if len(s) > limits.max_stop_chars:
            raise too_many(f"stop[{i}]", len(s), limits.max_stop_chars, "characters")
    return stop


_TOKEN_ID = re.compile(r"\s*[+-]?\d+")


def read_logit_bias(
    body: Body, n_vocab: int, max_entries: int, max_chars: int = 1 << 20
) -> tuple[dict[int, float], tuple[tuple[str, float], ...]]:
    """llama-server's `logit_bias` forms: OpenAI's `{"key": bias}` or `[[key, bias], ...]`, where a
    key is a token id (a number, or a string holding one) or a text whose every token gets the bias;
    a bias of `false` bans the token(s). Returns the biases by token id and, still to be tokenized
    (`resolve_text_bias`), those by text."""
    raw = body.raw("logit_bias")
    if raw is None:
        return {}, ()
    pairs: list[tuple[Any, Any]]
    if isinstance(raw, dict):
        pairs = list(raw.items())
    elif isinstance(raw, list) and all(isinstance(p, list) and len(p) == 2 for p in raw):
        pairs = [(p[0], p[1]) for p in raw]
    else:
        raise BadRequest(
            "'logit_bias' must be an object {token_id_or_text: bias} or an array of [token_id_or_text, bias] "
            f"pairs, got {json_type(raw)}",
            param="logit_bias",
        )
    check_count("logit_bias", pairs, max_entries)
    by_id: dict[int, float] = {}
    by_text: list[tuple[str, float]] = []
    n_chars = 0
    for key, bias in pairs:
        if bias is False:
            value = -math.inf
        elif isinstance(bias, int | float) and not isinstance(bias, bool):
            value = float(bias)
        else:
            raise BadRequest(
                f"'logit_bias' bias for {key!r} must be a number or false, got {json_type(bias)}",
                param="logit_bias",
            )
        if _is_token_id(key):
            token = int(key)
            if not 0 <= token < n_vocab:
                raise BadRequest(
                    f"'logit_bias' token {token} is outside the vocabulary (0..{n_vocab - 1})",
                    param="logit_bias",
                )
            by_id[token] = value
        elif isinstance(key, str) and key:
            n_chars += len(key)
            by_text.append((key, value))
        else:
            raise BadRequest(
                f"'logit_bias' key {key!r} is neither a token id nor a non-empty text", param="logit_bias"
            )
    if n_chars > max_chars:
        raise too_many("logit_bias", n_chars, max_chars, "characters of text in its keys")
    return by_id, tuple(by_text)


def _is_token_id(key: Any) -> bool:
    """A number, or a string holding one (llama-server parses object keys with strtol)."""
    if isinstance(key, str):
        return _TOKEN_ID.fullmatch(key) is not None
    return isinstance(key, int) and not isinstance(key, bool)


def resolve_text_bias(s: Sampling, tokenize: Callable[[str], list[int]], max_entries: int) -> Sampling:
    """`s` with its text-keyed biases applied to the tokens of each text (tokenized without special
    tokens, as llama-server does) — at most `max_entries` biased tokens in all, since the sampler
    applies each of them on every step. A text-keyed bias wins over an id-keyed one on the same token.
    Tokenizing is work the client sized: run this in a worker thread."""
    if not s.logit_bias_text:
        return s
    bias = dict(s.logit_bias)
    for text, value in s.logit_bias_text:
        for token in tokenize(text):
            bias[token] = value
    if len(bias) > max_entries:
        raise BadRequest(
            f"'logit_bias' biases {len(bias)} tokens once its texts are tokenized; "
            f"this engine accepts at most {max_entries}",
            param="logit_bias",
            extra={"limit": max_entries},
        )
    return replace(s, logit_bias=bias, logit_bias_text=())


def ban_end_of_generation(s: Sampling, eog_tokens: Iterable[int]) -> Sampling:
    """`s` with `ignore_eos` carried out as llama-server does: every end-of-generation token gets a
    -inf bias (over any bias the client gave it), so it is never sampled and its echo in
    `generation_settings.logit_bias` shows the bans. `eog_tokens`: ids, -1 for "none"."""
    bans = {t: -math.inf for t in eog_tokens if t >= 0}
    if not s.ignore_eos or not bans:
        return s
    return replace(s, logit_bias={**s.logit_bias, **bans})


# The options the core's RequestParams and llama-server's `generation_settings` echo both carry
# under Sampling's own names, in the echo's order.
_SAME_NAMED = (
    "n_predict",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "repeat_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
    "ignore_eos",
    "cache_prompt",
)


def to_native(
    s: Sampling,
    prompt: list[int],
    *,
    grammar: str = "",
    triggers: GrammarTriggers | None = None,
    checkpoint_hints: list[int] | None = None,
    extra_bias: dict[int, float] | None = None,
    n_slots: int = 1,
    preserved: frozenset[int] = frozenset(),
) -> native.RequestParams:
    """The core's RequestParams for a tokenized prompt. Stop strings are matched twice: by the
    core, which ends the decode run on the token completing one (so the slot holds exactly the
    tokens up to it, however late its events are read), and in Python (text.TextStream), which
    holds them back from the text; `preserved` tokens count with their special text in both."""
    p = native.RequestParams(prompt)
    p.prefix_sources = list(range(n_slots)) if s.prefix_slots is None else list(s.prefix_slots)
    p.owner = s.slot_owner
    for name in _SAME_NAMED:
        setattr(p, name, getattr(s, name))
    if s.logit_bias_text:
        raise ValueError("text-keyed logit biases must be resolved (resolve_text_bias) before submitting")
    p.logit_bias = {**s.logit_bias, **(extra_bias or {})}
    p.n_probs = s.n_probs
    p.report_progress = s.return_progress
    p.timings_per_token = s.timings_per_token
    p.stop_strings = list(s.stop)
    p.preserved_tokens = sorted(preserved)
    p.grammar = grammar
    if triggers is not None and grammar:
        p.grammar_lazy = triggers.lazy
        p.grammar_trigger_patterns = list(triggers.patterns)
        p.grammar_trigger_tokens = list(triggers.tokens)
        p.grammar_prefill = list(triggers.prefill)
    p.checkpoint_hints = sorted(set(checkpoint_hints or []))
    return p


def generation_settings(s: Sampling) -> dict[str, Any]:
    """llama-server's `generation_settings` echo of the options in effect."""
    return {
        **{name: getattr(s, name) for name in _SAME_NAMED},
        "stop": list(s.stop),
        "n_probs": s.n_probs,
        "post_sampling_probs": False,
        # llama-server's echo: a ban (-inf) reads as null there too.
        "logit_bias": [
            {"bias": b if math.isfinite(b) else None, "token": t} for t, b in s.logit_bias.items()
        ],
    }

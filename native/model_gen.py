"""Deterministic random-weight GGUF models that llama.cpp loads and decodes.

`write_model(path, arch, size, seed)` writes a model whose weights are random but reproducible: the
same (arch, size, seed) always gives a byte-identical file, and the seed and size are recorded in the
header (`general.name`, `slotkeeper.seed`, `slotkeeper.size`). The values carry no meaning; only the
shapes matter, so a `bench` model costs as much to prefill as a trained model of the same dimensions.

Every architecture is one row of `ARCH_SPECS`: hyperparameters per size, the tensors of one block
and the architecture-specific metadata keys. Tensor names, shapes (ggml `ne` order, fastest
dimension first) and keys follow llama.cpp's `src/models/<arch>.cpp`; llama.cpp refuses a file with
a missing or an extra tensor.

Only numpy, gguf and the standard library are imported, so this module works without the compiled
extension (`python native/model_gen.py --arch qwen35 out.gguf`, or `slotkeeper make-model ...`).
"""

import argparse
import itertools
import logging
import os
import string
import sys
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np

ARCHS = ("llama", "gemma2", "mamba2", "lfm2", "qwen35")
SIZES = ("tiny", "bench")

WEIGHT_STD = 0.05  # small enough that activations stay finite through every block
CONV_STD = 0.5  # conv kernels have only a few taps; a larger std keeps their output from vanishing
RMS_EPS = 1e-6

# --------------------------------------------------------------------------------------------------
# Hyperparameters and tensors


@dataclass(frozen=True)
class Ssm:
    """Hyperparameters of the recurrent layers (the `ssm.*` keys). Those a family does not use stay 0."""

    conv: int = 0  # conv kernel width (lfm2: shortconv.l_cache)
    state: int = 0  # mamba2 d_state; qwen35 head dim of the Gated DeltaNet
    heads: int = 0  # mamba2 heads; qwen35 value heads (ssm.time_step_rank)
    groups: int = 0  # mamba2 B/C groups; qwen35 key heads (ssm.group_count)
    inner: int = 0  # mamba2 d_inner


@dataclass(frozen=True)
class Dims:
    """Hyperparameters of one model. Fields an architecture does not use stay 0."""

    n_vocab: int
    n_embd: int
    n_layer: int
    n_ff: int = 0
    n_head: int = 0
    n_head_kv: int = 0
    head_dim: int = 0
    # Layer il is an attention layer iff attn_every > 0 and (il + 1) % attn_every == 0, the rule of
    # qwen35's full_attention_interval; the other layers are recurrent. 1: all attention, 0: none.
    attn_every: int = 1
    n_ctx_train: int = 4096
    sliding_window: int = 0
    ssm: Ssm = Ssm()
    f16: bool = False  # store weight matrices as f16 (norms, biases and conv kernels stay f32)

    def is_attention(self, il: int) -> bool:
        return self.attn_every > 0 and (il + 1) % self.attn_every == 0


@dataclass(frozen=True)
class Tensor:
    """One tensor to write: `ne` is in ggml order (the numpy shape reversed)."""

    name: str
    ne: tuple[int, ...]
    init: str = "normal"  # a key of _INITS


_INITS: dict[str, Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]] = {
    "normal": lambda rng, shape: rng.standard_normal(shape, dtype=np.float32) * np.float32(WEIGHT_STD),
    "conv": lambda rng, shape: rng.standard_normal(shape, dtype=np.float32) * np.float32(CONV_STD),
    "ones": lambda rng, shape: np.ones(shape, dtype=np.float32),
    # SSM A must be negative (a decay); |A| <= 1 keeps memory of the last few dozen tokens, so a
    # wrong recurrent state shows up in the logits.
    "decay": lambda rng, shape: -rng.uniform(0.1, 1.0, shape).astype(np.float32),
}


def _dtype(tensor: Tensor, dims: Dims) -> type[np.floating[Any]]:
    return np.float16 if dims.f16 and tensor.init == "normal" and len(tensor.ne) == 2 else np.float32


def _values(tensor: Tensor, dims: Dims, seed: int) -> np.ndarray:
    # One generator per tensor, seeded from (seed, name): a tensor's values do not depend on the
    # order or number of other tensors, and crc32 (unlike hash()) is stable across processes.
    rng = np.random.default_rng([seed, zlib.crc32(tensor.name.encode())])
    values = _INITS[tensor.init](rng, tensor.ne[::-1])
    return values.astype(_dtype(tensor, dims), copy=False)


def _norm(name: str, n: int) -> Tensor:
    return Tensor(name, (n,), "ones")


def _ffn(d: Dims, il: int) -> list[Tensor]:
    return [
        Tensor(f"blk.{il}.ffn_gate.weight", (d.n_embd, d.n_ff)),
        Tensor(f"blk.{il}.ffn_up.weight", (d.n_embd, d.n_ff)),
        Tensor(f"blk.{il}.ffn_down.weight", (d.n_ff, d.n_embd)),
    ]


def _attn(d: Dims, il: int, q_rows: int) -> list[Tensor]:
    kv_rows = d.head_dim * d.n_head_kv
    return [
        Tensor(f"blk.{il}.attn_q.weight", (d.n_embd, q_rows)),
        Tensor(f"blk.{il}.attn_k.weight", (d.n_embd, kv_rows)),
        Tensor(f"blk.{il}.attn_v.weight", (d.n_embd, kv_rows)),
        Tensor(f"blk.{il}.attn_output.weight", (d.head_dim * d.n_head, d.n_embd)),
    ]


def _qk_norms(d: Dims, il: int) -> list[Tensor]:
    return [
        _norm(f"blk.{il}.attn_q_norm.weight", d.head_dim),
        _norm(f"blk.{il}.attn_k_norm.weight", d.head_dim),
    ]


def _llama_block(d: Dims, il: int) -> list[Tensor]:
    return [
        _norm(f"blk.{il}.attn_norm.weight", d.n_embd),
        *_attn(d, il, q_rows=d.head_dim * d.n_head),
        _norm(f"blk.{il}.ffn_norm.weight", d.n_embd),
        *_ffn(d, il),
    ]


def _gemma2_block(d: Dims, il: int) -> list[Tensor]:
    return [
        *_llama_block(d, il),
        _norm(f"blk.{il}.post_attention_norm.weight", d.n_embd),
        _norm(f"blk.{il}.post_ffw_norm.weight", d.n_embd),
    ]


def _mamba2_block(d: Dims, il: int) -> list[Tensor]:
    conv_dim = d.ssm.inner + 2 * d.ssm.groups * d.ssm.state
    in_proj = d.ssm.inner + conv_dim + d.ssm.heads  # z, xBC, dt
    return [
        _norm(f"blk.{il}.attn_norm.weight", d.n_embd),
        Tensor(f"blk.{il}.ssm_in.weight", (d.n_embd, in_proj)),
        Tensor(f"blk.{il}.ssm_conv1d.weight", (d.ssm.conv, conv_dim), "conv"),
        Tensor(f"blk.{il}.ssm_conv1d.bias", (conv_dim,)),
        Tensor(f"blk.{il}.ssm_dt.bias", (d.ssm.heads,)),
        Tensor(f"blk.{il}.ssm_a", (1, d.ssm.heads), "decay"),
        Tensor(f"blk.{il}.ssm_d", (1, d.ssm.heads), "ones"),
        Tensor(f"blk.{il}.ssm_norm.weight", (d.ssm.inner // d.ssm.groups, d.ssm.groups), "ones"),
        Tensor(f"blk.{il}.ssm_out.weight", (d.ssm.inner, d.n_embd)),
    ]


# The hybrid families: each layer's mixer is attention or recurrent (`Dims.is_attention`), between
# tensors every layer has.


def _lfm2_mixer(d: Dims, il: int) -> list[Tensor]:
    if d.is_attention(il):
        return [*_qk_norms(d, il), *_attn(d, il, q_rows=d.n_embd)]
    return [
        Tensor(f"blk.{il}.shortconv.conv.weight", (d.ssm.conv, d.n_embd), "conv"),
        Tensor(f"blk.{il}.shortconv.in_proj.weight", (d.n_embd, 3 * d.n_embd)),
        Tensor(f"blk.{il}.shortconv.out_proj.weight", (d.n_embd, d.n_embd)),
    ]


def _lfm2_block(d: Dims, il: int) -> list[Tensor]:
    return [
        _norm(f"blk.{il}.ffn_norm.weight", d.n_embd),
        *_ffn(d, il),
        _norm(f"blk.{il}.attn_norm.weight", d.n_embd),
        *_lfm2_mixer(d, il),
    ]


def _qwen35_mixer(d: Dims, il: int) -> list[Tensor]:
    if d.is_attention(il):
        # attn_q holds the query and the output gate of every head.
        return [*_attn(d, il, q_rows=2 * d.head_dim * d.n_head), *_qk_norms(d, il)]
    # A Gated DeltaNet.
    key_dim = d.ssm.state * d.ssm.groups
    value_dim = d.ssm.state * d.ssm.heads
    conv_dim = 2 * key_dim + value_dim
    return [
        Tensor(f"blk.{il}.attn_qkv.weight", (d.n_embd, conv_dim)),
        Tensor(f"blk.{il}.attn_gate.weight", (d.n_embd, value_dim)),
        Tensor(f"blk.{il}.ssm_conv1d.weight", (d.ssm.conv, conv_dim), "conv"),
        Tensor(f"blk.{il}.ssm_dt.bias", (d.ssm.heads,)),
        Tensor(f"blk.{il}.ssm_a", (d.ssm.heads,), "decay"),
        Tensor(f"blk.{il}.ssm_beta.weight", (d.n_embd, d.ssm.heads)),
        Tensor(f"blk.{il}.ssm_alpha.weight", (d.n_embd, d.ssm.heads)),
        Tensor(f"blk.{il}.ssm_norm.weight", (d.ssm.state,), "ones"),
        Tensor(f"blk.{il}.ssm_out.weight", (value_dim, d.n_embd)),
    ]


def _qwen35_block(d: Dims, il: int) -> list[Tensor]:
    # post_attention_norm is the FFN pre-norm; there is no ffn_norm.
    return [
        _norm(f"blk.{il}.attn_norm.weight", d.n_embd),
        _norm(f"blk.{il}.post_attention_norm.weight", d.n_embd),
        *_qwen35_mixer(d, il),
        *_ffn(d, il),
    ]


# --------------------------------------------------------------------------------------------------
# Architecture-specific metadata (keys without the "{arch}." prefix)

# A GGUF header value, as `_add_kv` writes it: a boolean, an integer (u32), a float (f32), a string,
# or an array of one of those.
MetaValue = bool | int | float | str | list[int] | list[float] | list[str]


def _llama_meta(d: Dims) -> dict[str, MetaValue]:
    return {"rope.dimension_count": d.head_dim}


def _gemma2_meta(d: Dims) -> dict[str, MetaValue]:
    return {
        "attention.key_length": d.head_dim,
        "attention.value_length": d.head_dim,
        "attention.sliding_window": d.sliding_window,
        "attention.sliding_window_pattern": 2,  # even layers slide, odd layers see everything
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    }


def _mamba2_meta(d: Dims) -> dict[str, MetaValue]:
    return {
        "ssm.conv_kernel": d.ssm.conv,
        "ssm.inner_size": d.ssm.inner,
        "ssm.state_size": d.ssm.state,
        "ssm.time_step_rank": d.ssm.heads,
        "ssm.group_count": d.ssm.groups,
    }


def _lfm2_meta(d: Dims) -> dict[str, MetaValue]:
    # head_count_kv == 0 is what marks a shortconv layer.
    kv = [d.n_head_kv if d.is_attention(il) else 0 for il in range(d.n_layer)]
    return {"shortconv.l_cache": d.ssm.conv, "attention.head_count_kv": kv}


def _qwen35_meta(d: Dims) -> dict[str, MetaValue]:
    # Partial rotary embedding as in Qwen3.5 (a quarter of the head); the text-only M-RoPE sections
    # count rotated pairs and must sum to n_rot / 2.
    n_rot = d.head_dim // 4
    half = n_rot // 2
    sections = [half - 2 * (half // 3), half // 3, half // 3, 0]
    return {
        "full_attention_interval": d.attn_every,
        "attention.key_length": d.head_dim,
        "attention.value_length": d.head_dim,
        "rope.dimension_count": n_rot,
        "rope.dimension_sections": sections,
        "ssm.conv_kernel": d.ssm.conv,
        "ssm.state_size": d.ssm.state,
        "ssm.group_count": d.ssm.groups,
        "ssm.time_step_rank": d.ssm.heads,
        "ssm.inner_size": d.ssm.state * d.ssm.heads,
    }


@dataclass(frozen=True)
class ArchSpec:
    """How to build one architecture: its sizes, one block's tensors and its own metadata keys."""

    sizes: Mapping[str, Dims]
    block: Callable[[Dims, int], list[Tensor]]
    metadata: Callable[[Dims], dict[str, MetaValue]]
    output_norm: str = "output_norm"  # lfm2 names its final norm token_embd_norm


_TINY_VOCAB = 1024
# The attention shape the tiny models share; each row below says what its family changes.
_TINY = Dims(n_vocab=_TINY_VOCAB, n_embd=128, n_layer=2, n_ff=256, n_head=4, n_head_kv=2, head_dim=32)

ARCH_SPECS: dict[str, ArchSpec] = {
    "llama": ArchSpec(sizes={"tiny": _TINY}, block=_llama_block, metadata=_llama_meta),
    "gemma2": ArchSpec(
        sizes={"tiny": replace(_TINY, n_layer=4, sliding_window=32)},
        block=_gemma2_block,
        metadata=_gemma2_meta,
    ),
    "mamba2": ArchSpec(
        sizes={
            "tiny": Dims(
                n_vocab=_TINY_VOCAB,
                n_embd=128,
                n_layer=2,
                attn_every=0,
                ssm=Ssm(conv=4, state=32, heads=8, groups=1, inner=256),
            ),
        },
        block=_mamba2_block,
        metadata=_mamba2_meta,
    ),
    "lfm2": ArchSpec(
        # shortconv, attention, shortconv, attention
        sizes={"tiny": replace(_TINY, n_layer=4, attn_every=2, ssm=Ssm(conv=3))},
        block=_lfm2_block,
        metadata=_lfm2_meta,
        output_norm="token_embd_norm",
    ),
    "qwen35": ArchSpec(
        sizes={
            # 3 Gated DeltaNet layers, then 1 attention layer: the ratio of the real family.
            "tiny": replace(_TINY, n_layer=4, attn_every=4, ssm=Ssm(conv=4, state=32, heads=4, groups=2)),
            # ~211M parameters in Qwen3.5-0.8B-like proportions, fewer layers: 12 GDN + 4 attention.
            "bench": Dims(
                n_vocab=32000,
                n_embd=1024,
                n_layer=16,
                n_ff=2048,
                n_head=8,
                n_head_kv=2,
                head_dim=128,
                attn_every=4,
                n_ctx_train=32768,
                ssm=Ssm(conv=4, state=128, heads=8, groups=8),
                f16=True,
            ),
        },
        block=_qwen35_block,
        metadata=_qwen35_meta,
    ),
}


def _tensors(spec: ArchSpec, d: Dims) -> list[Tensor]:
    # The output projection is tied to token_embd (no `output` tensor), as llama.cpp allows for all five.
    blocks = (t for il in range(d.n_layer) for t in spec.block(d, il))
    return [
        Tensor("token_embd.weight", (d.n_embd, d.n_vocab)),
        *blocks,
        _norm(f"{spec.output_norm}.weight", d.n_embd),
    ]


# --------------------------------------------------------------------------------------------------
# Tokenizer: SentencePiece-style ("llama") with byte fallback, so any UTF-8 text round-trips


SPECIAL_TOKENS: tuple[tuple[str, gguf.TokenType], ...] = (
    ("<unk>", gguf.TokenType.UNKNOWN),
    ("<s>", gguf.TokenType.CONTROL),
    ("</s>", gguf.TokenType.CONTROL),
    ("<|im_start|>", gguf.TokenType.CONTROL),
    ("<|im_end|>", gguf.TokenType.CONTROL),
    # Matched in text even without parse_special, like Qwen's non-special added tokens.
    ("<tool_call>", gguf.TokenType.USER_DEFINED),
    ("</tool_call>", gguf.TokenType.USER_DEFINED),
    ("<think>", gguf.TokenType.USER_DEFINED),
    ("</think>", gguf.TokenType.USER_DEFINED),
)
# LFM2's tags, single tokens in Liquid's vocabulary. They take the LAST ids (the last pieces of the
# list made room), so that every token before them kept its id and its embedding. CONTROL, as in
# Liquid's GGUFs: llama.cpp renders them only when asked to, so the engine must preserve the ones its
# chat format reads (as llama-server does) for calls to be seen at all.
FAMILY_TOKENS: tuple[str, ...] = (
    "<|tool_list_start|>",
    "<|tool_list_end|>",
    "<|tool_call_start|>",
    "<|tool_call_end|>",
    "<|tool_response_start|>",
    "<|tool_response_end|>",
)

_SPACE = "\u2581"  # SentencePiece's visible space

# Frequent words first: a small vocabulary keeps only the head of this list.
_WORDS = """
user assistant system tool function name arguments content role type text true false null
the of and to in is it you that was for on are with as be at this have from or one had by not but
what all were we when your can said there use an each which she do how their if will up other about
out many then them these so some her would make like him into time has look two more write go see
number no way could people my than first water been call who its now find long down day did get come
made may part over new sound take only little work know place year live me back give most very after
thing our just good sentence man think say great where help through much before line right too mean
old any same tell follow came want show also around form three small set put end does another well
large must big even such because turn here why ask went men read need land different home move try
kind hand picture again change off play air away animal house point page letter mother answer found
study still learn should world hello model state slot cache token return def class import self print
value data list string int json error file path test
"""
_SUFFIXES = ("ing", "ed", "er", "ly", "tion", "es", "'s", "n't")
_CODE_PIECES = ('":', '",', '{"', '"}', "()", "):", "->", "==", "!=", "</", "/>", "//", "**", "...")


def _with_prefixes(piece: str) -> Iterator[str]:
    # SPM only builds a piece by merging two pieces already in the vocabulary, so every prefix
    # must be a piece too or the word could never be produced.
    return (piece[:k] for k in range(1, len(piece) + 1))


def _pieces() -> Iterator[str]:
    """Normal pieces in rank order: ASCII characters, affixes, common words, then letter n-grams.

    Words come both with the SentencePiece space marker (inside text) and without it (at the start
    of the text or after a special token, since no space prefix is added); a small vocabulary keeps
    the head of this sequence.
    """
    yield from string.printable[:94]  # printable ASCII without whitespace
    for piece in (*_SUFFIXES, *_CODE_PIECES):
        yield from _with_prefixes(piece)
        yield from _with_prefixes(_SPACE + piece)
    for word in _WORDS.split():
        yield from _with_prefixes(_SPACE + word)
        yield from _with_prefixes(word)
    for n in itertools.count(2):
        for letters in itertools.product(string.ascii_lowercase, repeat=n):
            yield "".join(letters)
            yield _SPACE + "".join(letters)


@dataclass(frozen=True)
class Vocab:
    """Token texts, SPM scores and llama.cpp token types, indexed by token id."""

    tokens: list[str]
    scores: list[float]
    types: list[int]

    def id(self, text: str) -> int:
        return self.tokens.index(text)


def build_vocab(n_vocab: int) -> Vocab:
    """The vocabulary of every generated model with `n_vocab` tokens (deterministic).

    Ids: `<unk>` 0, `<s>` 1, `</s>` 2, the ChatML specials, the 256 byte tokens, `▁`, pieces, and
    last the family tags (FAMILY_TOKENS). Byte fallback makes any UTF-8 text round-trip through
    llama.cpp's tokenizer, except a literal U+2581 (`▁`), which SentencePiece cannot tell from a
    space.
    """
    fixed: list[tuple[str, int]] = [(text, int(kind)) for text, kind in SPECIAL_TOKENS]
    fixed += [(f"<0x{b:02X}>", int(gguf.TokenType.BYTE)) for b in range(256)]
    fixed.append((_SPACE, int(gguf.TokenType.NORMAL)))
    seen = {text for text, _ in fixed}
    normal: list[str] = []
    for piece in _pieces():
        if len(fixed) + len(normal) + len(FAMILY_TOKENS) == n_vocab:
            break
        if piece not in seen:
            seen.add(piece)
            normal.append(piece)
    tokens = [text for text, _ in fixed] + normal + list(FAMILY_TOKENS)
    types = [kind for _, kind in fixed] + [int(gguf.TokenType.NORMAL)] * len(normal)
    types += [int(gguf.TokenType.CONTROL)] * len(FAMILY_TOKENS)
    # Earlier pieces win merges (higher score); special and byte tokens never take part in merges.
    scores = [0.0] * len(fixed) + [-float(rank) for rank in range(1, len(normal) + 1)]
    scores += [0.0] * len(FAMILY_TOKENS)
    return Vocab(tokens, scores, types)


# Chat templates of the model families, written for these models after each family's documented
# format (one file each in chat_templates/). `hermes` is ChatML with Hermes-style JSON tool calls
# (Qwen2.5/Qwen3); `qwen35` and `nemotron` use XML tool calls and a reasoning block the generation
# prompt opens; `lfm2` Python-call tool calls between single-token tags; `granite` JSON tool calls
# in Granite 4.0's role markup. They render with a plain sandboxed jinja2 environment. `tojson`
# output is never concatenated with `+`: jinja2's own tojson returns Markup, which would HTML-escape
# the other operand (the engine's environment returns plain JSON, as llama.cpp's does).
TEMPLATES = ("hermes", "qwen35", "lfm2", "granite", "nemotron")
_TEMPLATE_DIR = Path(__file__).resolve().parent / "chat_templates"


def chat_template(name: str) -> str:
    """The jinja source of the chat template `name` (one of TEMPLATES)."""
    if name not in TEMPLATES:
        raise ValueError(f"unknown chat template {name!r}; choose one of {', '.join(TEMPLATES)}")
    return (_TEMPLATE_DIR / f"{name}.jinja").read_text(encoding="utf-8")


CHAT_TEMPLATE = chat_template("hermes")


def _tokenizer_metadata(vocab: Vocab, template: str) -> dict[str, MetaValue]:
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": vocab.tokens,
        "tokenizer.ggml.scores": vocab.scores,
        "tokenizer.ggml.token_type": vocab.types,
        "tokenizer.ggml.unknown_token_id": vocab.id("<unk>"),
        "tokenizer.ggml.bos_token_id": vocab.id("<s>"),
        "tokenizer.ggml.eos_token_id": vocab.id("</s>"),
        # <|im_end|> ends a ChatML turn: llama.cpp counts it as end-of-generation.
        "tokenizer.ggml.eot_token_id": vocab.id("<|im_end|>"),
        "tokenizer.ggml.padding_token_id": vocab.id("<unk>"),
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        # No implicit leading space: text after a special token (ChatML) must not gain one.
        "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.chat_template": template,
    }


# --------------------------------------------------------------------------------------------------
# Writing


def _metadata(
    arch: str, spec: ArchSpec, d: Dims, size: str, seed: int, template: str
) -> dict[str, MetaValue]:
    common: dict[str, MetaValue] = {
        "vocab_size": d.n_vocab,
        "context_length": d.n_ctx_train,
        "embedding_length": d.n_embd,
        "block_count": d.n_layer,
        "feed_forward_length": d.n_ff,
        "attention.head_count": d.n_head,
        "attention.head_count_kv": d.n_head_kv,
        "attention.layer_norm_rms_epsilon": RMS_EPS,
        "rope.freq_base": 10000.0,
    }
    arch_keys = {f"{arch}.{key}": value for key, value in (common | spec.metadata(d)).items()}
    general: dict[str, MetaValue] = {
        "general.name": f"slotkeeper-{arch}-{size}-seed{seed}",
        "general.file_type": int(gguf.LlamaFileType.MOSTLY_F16 if d.f16 else gguf.LlamaFileType.ALL_F32),
        "slotkeeper.seed": seed,
        "slotkeeper.size": size,
    }
    return general | arch_keys | _tokenizer_metadata(build_vocab(d.n_vocab), chat_template(template))


def _add_kv(writer: gguf.GGUFWriter, key: str, value: MetaValue) -> None:
    # llama.cpp reads scalar integers as u32 and accepts i32 arrays for u32 array keys.
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list):
        writer.add_array(key, value)
    else:
        raise TypeError(f"unsupported metadata value for {key}: {value!r}")


def _resolve(arch: str, size: str) -> tuple[ArchSpec, Dims]:
    spec = ARCH_SPECS.get(arch)
    if spec is None:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    dims = spec.sizes.get(size)
    if dims is None:
        raise ValueError(f"{arch} has no {size!r} size; it has {', '.join(spec.sizes)}")
    return spec, dims


def param_count(arch: str, size: str = "tiny") -> int:
    """Number of weights of the model `write_model(_, arch, size)` writes."""
    spec, dims = _resolve(arch, size)
    return sum(int(np.prod(t.ne)) for t in _tensors(spec, dims))


def cached_model(directory: str | os.PathLike[str], arch: str, size: str = "tiny", seed: int = 0) -> str:
    """Path of `{arch}-{size}-seed{seed}.gguf` in `directory`, written first if it is not there yet
    (generation is deterministic, so a cached file is the same model)."""
    path = os.path.join(os.fspath(directory), f"{arch}-{size}-seed{seed}.gguf")
    if not os.path.exists(path):
        os.makedirs(os.fspath(directory), exist_ok=True)
        write_model(path, arch, size=size, seed=seed)
    return path


def write_model(
    path: str | os.PathLike[str], arch: str, size: str = "tiny", seed: int = 0, template: str = "hermes"
) -> None:
    """Write a random-weight GGUF model of `arch` ("llama", "gemma2", "mamba2", "lfm2", "qwen35").

    `size` is "tiny" (a few MB, fast on CPU) or, for qwen35 only, "bench" (~210M f16 parameters).
    `template` names the chat template it carries (TEMPLATES; any with any architecture).
    The same (arch, size, seed, template) always produces a byte-identical file; `seed` must fit in
    32 bits. Tensors are generated and written one at a time, so memory stays at about the largest
    tensor. The file appears atomically: it is written beside `path` and renamed into place.
    Raises ValueError for an unknown architecture, template, a size the architecture lacks, or a
    bad seed.
    """
    spec, dims = _resolve(arch, size)
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    if template not in TEMPLATES:
        raise ValueError(f"unknown chat template {template!r}; choose one of {', '.join(TEMPLATES)}")
    tensors = _tensors(spec, dims)
    path = Path(path)
    partial = path.with_name(path.name + ".part")
    # The writer's info lines (endianness, the file list) are nothing a caller of serve asked for.
    logging.getLogger(gguf.gguf_writer.__name__).setLevel(logging.WARNING)
    writer = gguf.GGUFWriter(partial, arch)
    try:
        for key, value in _metadata(arch, spec, dims, size, seed, template).items():
            _add_kv(writer, key, value)
        for t in tensors:
            dtype = np.dtype(_dtype(t, dims))
            writer.add_tensor_info(t.name, t.ne[::-1], dtype, int(np.prod(t.ne)) * dtype.itemsize)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tensors:
            writer.write_tensor_data(_values(t, dims, seed))
        writer.close()
        os.replace(partial, path)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise


def _seed(text: str) -> int:
    value = int(text)
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"seed must be in [0, 2**32), got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """`slotkeeper make-model --arch ARCH [--size tiny|bench] [--seed N] [--template NAME] OUT.gguf`;
    returns the exit code.

    Usage errors (including a size the architecture lacks) exit with status 2 through argparse.
    """
    parser = argparse.ArgumentParser(
        prog="slotkeeper make-model",
        description="Write a deterministic random-weight GGUF model for tests and benchmarks.",
    )
    parser.add_argument("--arch", required=True, choices=ARCHS)
    parser.add_argument("--size", default="tiny", choices=SIZES)
    parser.add_argument("--seed", type=_seed, default=0)
    parser.add_argument(
        "--template", default="hermes", choices=TEMPLATES, help="the chat template of a model family (hermes)"
    )
    parser.add_argument("out", type=Path, metavar="OUT.gguf")
    args = parser.parse_args(argv)
    if args.size not in ARCH_SPECS[args.arch].sizes:
        having = [arch for arch, spec in ARCH_SPECS.items() if args.size in spec.sizes]
        parser.error(f"--size {args.size} is only available for --arch {', '.join(having)}")
    write_model(args.out, args.arch, args.size, args.seed, args.template)
    n_params = param_count(args.arch, args.size)
    mib = args.out.stat().st_size / 2**20
    print(
        f"wrote {args.out}: {args.arch} {args.size} seed {args.seed}, {args.template} template, "
        f"{n_params:,} params, {mib:.1f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Typed surface of the compiled core (native/src/bindings.cpp). Python never sees a raw pointer.

Use it through the `native` facade (native/__init__.py), which imports `llama_cpp` first so that
exactly one libllama is loaded in the process.
"""

from collections.abc import Callable
from typing import Final, Literal

STATE_SEQ_VERSION: int
"""LLAMA_STATE_SEQ_VERSION of the linked llama.cpp (3 for llama-cpp-python 0.3.36)."""
LLAMA_BUILD: str
"""Identifier of the linked llama.cpp build, recorded in slot files."""
ENGINE_VERSION: str
MAX_N_PROBS: int
"""The largest RequestParams.n_probs the core accepts (100)."""
KV_CACHE_TYPES: tuple[str, ...]
"""The KV cache types EngineConfig.cache_type_k/v accept, as llama-server's -ctk/-ctv: f32, f16,
bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1."""

class ModelInfo:
    path: str
    arch: str
    description: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_params: int
    size_bytes: int
    recurrent: bool
    hybrid: bool
    n_swa: int
    """Sliding-window size (0 = no SWA layers)."""
    chat_template: str
    """The GGUF's tokenizer.chat_template ('' when absent)."""
    bos: int
    eos: int
    eot: int
    """-1 when the vocabulary has none."""
    add_bos: bool
    fingerprint: str
    """Hex SHA-256 of the GGUF header, KV data and tensor table, the first MiB of tensor data and
    the file size."""
    meta: dict[str, str]

class EngineConfig:
    """Built once, by keyword; every field is read-only (Final) afterwards."""

    def __init__(
        self,
        model_path: str,
        *,
        n_slots: int = 1,
        n_ctx: int = 4096,
        n_batch: int = 512,
        n_ubatch: int = 512,
        n_threads: int = 0,
        n_gpu_layers: int = 0,
        checkpoint_interval: int = 2048,
        checkpoint_min_step: int = 64,
        max_checkpoints: int = 32,
        max_checkpoint_bytes: int = 1 << 30,
        max_stored_checkpoints: int = 8,
        max_stored_checkpoint_bytes: int = 512 << 20,
        max_slot_file_bytes: int = 0,
        swa_full: bool = False,
        flash_attn: bool = False,
        repack: bool = True,
        kv_unified: bool = False,
        cache_type_k: str = "f16",
        cache_type_v: str = "f16",
        use_mmap: bool = True,
        use_mlock: bool = False,
        warmup: bool = True,
        context_shift: bool = False,
    ) -> None: ...
    model_path: Final[str]
    n_slots: Final[int]
    n_ctx: Final[int]
    """Total KV cells (one unified stream); every slot may use n_ctx // n_slots of them, or all
    of them with kv_unified."""
    n_batch: Final[int]
    n_ubatch: Final[int]
    n_threads: Final[int]
    """0 = all hardware threads."""
    n_gpu_layers: Final[int]
    checkpoint_interval: Final[int]
    """Checkpoint every this many prompt tokens inside long prompts (0 = off)."""
    checkpoint_min_step: Final[int]
    """Hinted/interval checkpoints closer than this to another planned one are skipped."""
    max_checkpoints: Final[int]
    """Per slot. 0 disables checkpoints (hybrid/recurrent reuse then needs the exact end)."""
    max_checkpoint_bytes: Final[int]
    """Per slot, the sum of checkpoint state blobs and their logits."""
    max_stored_checkpoints: Final[int]
    """The checkpoints a slot file (save_slot, snapshot_slot) keeps of the slot's, at most: a
    ladder spaced geometrically toward the newest (native/DESIGN.md). 0: none."""
    max_stored_checkpoint_bytes: Final[int]
    """... and their bytes (state blobs and logits), at most."""
    max_slot_file_bytes: Final[int]
    """Refuse to restore larger slot files (0 = no limit beyond the bounds checks)."""
    swa_full: Final[bool]
    flash_attn: Final[bool]
    repack: Final[bool]
    kv_unified: Final[bool]
    """llama-server's --kv-unified: a slot may grow into the whole pool (Engine.n_ctx_slot ==
    n_ctx). When the shared cells run out, idle slots' cached sessions are dropped (least
    recently used first); then a prompt still being evaluated fails ("the KV cache is full"),
    else the longest generation shifts (context_shift) or stops with stop_reason "context"."""
    cache_type_k: Final[str]
    """KV cache type of K (KV_CACHE_TYPES). Unknown names raise InvalidRequestError."""
    cache_type_v: Final[str]
    """KV cache type of V; a quantized one needs flash_attn (InvalidRequestError otherwise). Slot
    files record both types and restore only into an engine with the same."""
    use_mmap: Final[bool]
    """False = --no-mmap: read the weights into memory instead of mapping the file."""
    use_mlock: Final[bool]
    """--mlock: lock the weights in RAM (llama.cpp warns and goes on when the limit is too low)."""
    warmup: Final[bool]
    """Decode BOS+EOS once at start and forget it, as llama-server does (--no-warmup: skip)."""
    context_shift: Final[bool]
    """--context-shift: a generating slot that reaches n_ctx_slot drops tokens after its
    request's n_keep and goes on. Refused at start (InvalidRequestError) for recurrent and
    hybrid models, and where llama.cpp cannot shift the cache (SWA without swa_full)."""

class RequestParams:
    def __init__(self, prompt: list[int] = ...) -> None: ...
    prompt: list[int]
    n_predict: int
    """-1 = until a stop condition or the slot's context is full; 0 = prompt processing only."""
    temperature: float
    """<= 0 is greedy."""
    top_k: int
    top_p: float
    min_p: float
    seed: int
    """-1 = random."""
    repeat_penalty: float
    repeat_last_n: int
    presence_penalty: float
    frequency_penalty: float
    logit_bias: dict[int, float]
    stop_tokens: list[int]
    stop_strings: list[str]
    """Generation ends (stop_reason "stop_word") on the token that completes one of these in the
    generated text, in the same loop step: the slot holds exactly the tokens up to it."""
    preserved_tokens: list[int]
    """Tokens whose special text counts for stop_strings (others count with their plain piece)."""
    ignore_eos: bool
    grammar: str
    """GBNF; '' = none. An invalid grammar is refused at submit."""
    grammar_lazy: bool
    """The grammar applies only from the first match of a trigger (pattern or token) on."""
    grammar_trigger_patterns: list[str]
    """Regexes over the generated text (llama.cpp's lazy-grammar patterns)."""
    grammar_trigger_tokens: list[int]
    grammar_prefill: list[int]
    """Tokens the grammar accepts before generation (the generation prompt a tool-call grammar
    begins with); one it refuses makes submit raise InvalidRequestError."""
    checkpoint_hints: list[int]
    """Token counts after which the state is worth a checkpoint (message boundaries)."""
    cache_prompt: bool
    """False: ignore the slot's cached tokens and evaluate the whole prompt."""
    prefix_sources: list[int]
    """Other slots the request may start from: when one of them serves at least 32 prompt tokens
    more than the request's own slot (its memory or a checkpoint inside the common prefix), the
    request's slot becomes a copy of it first (`Timings.source_slot`). Ids out of range and the
    request's own slot are ignored, and so are slots whose last request had another `owner`."""
    owner: str
    """Who the request runs for (the gateway: its tenant): its slot takes this owner, and it starts
    only from prefix sources of the same owner (restores and erases clear a slot's owner)."""
    n_probs: int
    """0 = off. 1..MAX_N_PROBS: every token event carries `logprob` and the n_probs most probable
    tokens (`top_logprobs`), from the raw logits of its position (a softmax over the vocabulary,
    before bias, penalties and grammar; llama-server's default). Outside that range submit raises
    InvalidRequestError."""
    n_keep: int
    """Context shift: prompt tokens always kept (-1 = the whole prompt); the BOS is kept on top of
    it when the model adds one. At most n_ctx_slot - 4 are kept."""
    n_discard: int
    """Context shift: tokens dropped per shift (0 = half of those after the kept ones)."""
    report_progress: bool
    """llama-server's `return_progress`: `progress` events while the prompt is evaluated."""
    timings_per_token: bool
    """llama-server's `timings_per_token`: every token event carries the timings so far."""

class Timings:
    prompt_n: int
    """Prompt tokens evaluated."""
    cache_n: int
    """Prompt tokens reused without evaluation."""
    predicted_n: int
    prompt_ms: float
    predicted_ms: float
    reuse: Literal["none", "live", "checkpoint", "logits"]
    """How the reused prefix was served: the slot's memory as it was, a checkpoint rollback, or
    (identical prompt) the stored logits with nothing evaluated."""
    restored: bool
    """The slot's state came from a slot file restored since it last served a request."""
    source_slot: int
    """The slot whose state the request started from (one of its `prefix_sources`); -1: its own."""
    candidate_slot: int
    """The state the prompt was compared with: the slot it started from, else the one (its own or
    a source) sharing the longest common prefix with it."""
    candidate_n: int
    """Tokens that state held."""
    candidate_prompt_n: int
    """How many of them the last prompt it served had (the rest it generated); 0: unknown (a
    restored state)."""
    common_n: int
    """The prompt's common prefix with that state, in tokens."""
    checkpoints_created: int
    context_shifts: int
    """How often the context was shifted during generation (llama-server's `truncated` when > 0)."""

class Event:
    request_id: int
    """-1 for the engine-level `fault` event."""
    kind: Literal["token", "progress", "done", "error", "fault"]
    """`progress` (requests with `report_progress`): when the prompt's evaluation starts and after
    each prompt chunk, before the first token; `timings` then says what was reused (cache_n), what
    was evaluated so far (prompt_n) and how long that took (prompt_ms, 0 before the first chunk)."""
    """`fault`: the loop died of an exception (message = the reason); sent once, after every
    request's error event, and nothing follows it."""
    token: int
    piece: bytes
    """UTF-8 bytes of the token (may be a partial character)."""
    stop_reason: Literal["", "eos", "stop_token", "length", "context", "cancelled"]
    timings: Timings
    message: str
    slot: int
    logprob: float
    """Token events of a request with n_probs > 0: the sampled token's natural-log probability
    under the raw logits (0.0 otherwise)."""
    top_logprobs: list[tuple[int, float]]
    """Token events of a request with n_probs > 0: (token, logprob) of the min(n_probs, n_vocab)
    most probable tokens, most probable first (ties: lower id first). Empty otherwise."""
    prompt_total: int
    """Progress events: the prompt's tokens (0 otherwise)."""
    elapsed_ms: float
    """Progress events: milliseconds since the request started (0 otherwise)."""

class SlotFileInfo:
    path: str
    n_tokens: int
    n_bytes: int
    """Equal to the file's size on disk."""
    n_checkpoints: int
    ms: float

class SlotSnapshot:
    """A slot's state copied on the loop thread (Engine.snapshot_slot), for Engine.write_snapshot."""

    slot: int
    n_tokens: int

class SlotInfo:
    id: int
    busy: bool
    request_id: int
    """-1 when idle."""
    queued: int
    n_tokens: int
    n_checkpoints: int
    checkpoint_bytes: int
    restored: bool
    last_used: float
    """Monotonic seconds of the last request finish (0 = never)."""

class Engine:
    """One model, N slots on one llama_context (kv_unified), decode loop on its own thread."""

    def __init__(self, config: EngineConfig, on_load_progress: Callable[[float], None] | None = None) -> None:
        """`on_load_progress` hears the fraction of the weights loaded, once per tenth, on the
        loading thread."""
    @property
    def model(self) -> ModelInfo: ...
    @property
    def config(self) -> EngineConfig:
        """A copy of the configuration the engine was built with."""
    @property
    def n_ctx_slot(self) -> int:
        """A request's context limit: n_ctx // n_slots, or n_ctx with kv_unified. Prompts must be
        shorter; generation stops ("context") or shifts (context_shift) at it."""
    @property
    def kv_streams(self) -> bool:
        """Whether each slot has a KV stream of its own (llama.cpp's non-unified KV): for a plain
        hybrid model (attention + recurrent, no sliding window) with more than one slot, without
        kv_unified (each stream rounded up to 256 cells; n_ctx_slot as with one stream). Slot
        files are the same either way."""
    @property
    def closed(self) -> bool:
        """True once close() was called or the loop faulted: calls that need the loop raise
        EngineClosedError."""
    @property
    def fault(self) -> str:
        """Why the loop died of an exception ('' while healthy, or after a plain close())."""
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]: ...
    def detokenize(
        self, tokens: list[int], remove_special: bool = False, unparse_special: bool = True
    ) -> bytes:
        """UTF-8 bytes: a token may hold part of a character (the caller decodes)."""
    def token_piece(self, token: int, special: bool = True) -> bytes: ...
    def submit(self, slot: int, params: RequestParams) -> int:
        """Queue a request on `slot` (-1: the idle slot with the longest common prefix, else the
        least recently used). Requests for a busy slot wait in that slot's FIFO. Returns the id."""
    def cancel(self, request_id: int) -> bool:
        """Cancel and wait for the loop to confirm; False when the request had already ended."""
    def cancel_nowait(self, request_id: int) -> None:
        """Queue a cancel without waiting (safe in cleanup code); its done event still follows."""
    def poll(self) -> list[Event]:
        """Events ready now (never blocks)."""
    def wait(self, timeout_s: float) -> list[Event]:
        """Events, blocking up to timeout_s for the first (GIL released)."""
    def event_fd(self) -> int:
        """An eventfd that becomes readable when events are ready; poll() drains it."""
    def save_slot(self, slot: int, path: str) -> SlotFileInfo: ...
    def snapshot_slot(self, slot: int) -> SlotSnapshot:
        """The slot's state now, copied on the loop thread (SlotBusyError while it serves)."""
    def write_snapshot(self, snapshot: SlotSnapshot, path: str, durable: bool = True) -> SlotFileInfo:
        """The snapshot's slot file, written on the calling thread (the slot may serve meanwhile);
        ``durable``: synced to disk before it is renamed into place (a handoff's file is not)."""
    def restore_slot(self, slot: int, path: str) -> SlotFileInfo: ...
    def erase_slot(self, slot: int) -> int: ...
    def slots(self) -> list[SlotInfo]: ...
    def slot_tokens(self, slot: int) -> list[int]: ...
    def metrics(self) -> dict[str, int]: ...
    def close(self) -> None:
        """Stop the loop (pending requests end with an error event) and wait for its thread.

        Idempotent and thread-safe, also after a fault; the context is freed with the object."""
    def _inject_fault_for_tests(self, where: Literal["command", "checkpoint"] = "command") -> None:
        """TEST HOOK. Make the loop throw std::bad_alloc at the top of its next iteration
        ("command") or in its next checkpoint capture ("checkpoint"): the real fault path runs."""

class ChatLayer:
    """llama.cpp's chat layer (common/chat, vendored) over one template: its tool-call format,
    grammar and parser, as llama-server derives them. JSON text in and out."""

    def __init__(self, source: str, bos: str = "", eos: str = "") -> None:
        """InvalidRequestError when llama.cpp's jinja engine cannot read `source`."""
    def apply(self, request: str) -> str:
        """`request`: {"messages", "tools", "tool_choice", "parallel_tool_calls",
        "add_generation_prompt", "enable_thinking", "reasoning_format", "chat_template_kwargs"}.
        Returns {"format", "prompt", "grammar", "grammar_lazy", "grammar_triggers": [{"type",
        "value", "token"}], "preserved_tokens", "additional_stops", "generation_prompt", "parser",
        "supports_thinking", "thinking_start_tag", "thinking_end_tags"} (GIL released).
        InvalidRequestError for what the template or its format refuses."""

class ChatParser:
    """A model's output read in the format ChatLayer.apply reported."""

    def __init__(
        self,
        format: str,
        parser: str,
        generation_prompt: str,
        reasoning_format: str,
        parse_tool_calls: bool = True,
    ) -> None: ...
    def parse(self, text: str, partial: bool) -> str:
        """{"content", "reasoning_content", "tool_calls": [{"name", "arguments", "id"}]} (GIL
        released). InvalidRequestError when the text is not in the format."""

def read_fingerprint(model_path: str) -> str:
    """The model fingerprint computed from the GGUF file alone (no load)."""

def checkpoints_to_evict(ladder: list[tuple[int, str, int]], max_count: int, max_bytes: int) -> list[int]:
    """The core's choice of the checkpoints to drop from a ladder of (n_tokens, kind, bytes),
    ascending n_tokens (kind: prompt_end, hint or interval), to keep within the budget: indices,
    ascending. Pure (native/src/reuse.h)."""

def crc32(data: bytes, value: int = 0) -> int: ...

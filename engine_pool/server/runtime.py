"""What one engine process holds while it runs: settings, the native engine, slot leases, template, metrics.

Created by the app's lifespan and handed to every route through `request.app.state.runtime`. The
model loads in a worker thread (`load`), so the HTTP server answers — `/health` with 503 — while it
loads; every route that needs the model calls `require()`, which raises that same 503 until then.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import structlog

import native
from engine_pool.errors import ServerError, Unavailable
from engine_pool.pool.model_check import tensor_types

from .chat_template import ChatTemplate, TemplateConfigError, select_template, template_override
from .formats import UPSTREAM, select_format
from .formats.upstream import UpstreamChat
from .metrics import EngineMetrics
from .sampling import Sampling
from .settings import EngineSettings
from .slot_leases import SlotLeases


def cpu_has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU has AMX tiles, where llama.cpp's repacking puts weights in its AMX buffer
    type (`repack_weights`)."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return False
    return any(line.startswith("flags") and " amx_tile" in line for line in text.splitlines())


# Weight types that stay unquantized under repacking: F32, F16, BF16 (gguf.GGMLQuantizationType).
_PLAIN_TYPES = frozenset({0, 1, 30})


def repack_weights(no_repack: bool, amx: bool, weight_types: set[int]) -> bool:
    """Whether the engine loads with llama.cpp's extra weight buffer types (repacking). On AMX CPUs
    the AMX buffer type crashes multi-token batches over quantized weights (llama.cpp #20824: Q4_K),
    so a quantized model loads without it there; an F16/BF16/F32 model keeps it, as llama-server
    does: its F16 matmuls in the AMX buffer use fewer cycles per prompt token (docs/benchmarks.md,
    Prefill), and they were llama-server's whole lead on long prompts."""
    if no_repack:
        return False
    return not amx or weight_types <= _PLAIN_TYPES


log = structlog.get_logger("engine.runtime")


class Runtime:
    """The engine process's state; one per process (the native engine's events have one consumer)."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.engine: native.Engine | None = None
        self.template = ChatTemplate("")
        # llama.cpp's chat layer, for a template whose tool syntax none of our formats reads.
        self.upstream: UpstreamChat | None = None
        self.state = "loading"  # loading | ready | draining | failed | closed
        self.error = ""
        # The fraction of the weights loaded; written by the loading thread only, read by /health.
        self.load_progress = 0.0
        self.started = time.time()
        self.slot_dir = Path(settings.slot_save_path).resolve() if settings.slot_save_path else None
        self.defaults = Sampling(
            n_predict=settings.n_predict, temperature=settings.temperature, seed=settings.seed
        )
        self.leases = SlotLeases(
            settings.n_slots, settings.queue_size, settings.retry_after_s, self._fetch_tokens
        )
        self.metrics = EngineMetrics(self._core_metrics, self._gauges, settings.role)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # -- lifecycle ------------------------------------------------------------------------------
    def engine_config(self) -> native.EngineConfig:
        s = self.settings
        return native.EngineConfig(
            s.model,
            n_slots=s.n_slots,
            n_ctx=s.n_ctx,
            n_batch=s.n_batch,
            n_ubatch=s.n_ubatch,
            n_threads=s.n_threads,
            n_gpu_layers=s.n_gpu_layers,
            checkpoint_interval=s.checkpoint_interval,
            checkpoint_min_step=s.checkpoint_min_step,
            max_checkpoints=s.max_checkpoints,
            max_checkpoint_bytes=s.max_checkpoint_bytes,
            max_stored_checkpoints=s.max_stored_checkpoints,
            max_stored_checkpoint_bytes=s.max_stored_checkpoint_bytes,
            max_slot_file_bytes=s.max_slot_file_bytes,
            swa_full=s.swa_full,
            flash_attn=s.flash_attn,
            repack=repack_weights(s.no_repack, cpu_has_amx(), tensor_types(s.model)),
            kv_unified=s.kv_unified,
            cache_type_k=s.cache_type_k,
            cache_type_v=s.cache_type_v,
            use_mmap=not s.no_mmap,
            use_mlock=s.mlock,
            warmup=not s.no_warmup,
            context_shift=s.context_shift,
        )

    async def load(self) -> None:
        """Load the model in a thread. On failure the state becomes `failed` and the error is kept."""
        t0 = time.monotonic()
        self._loop = asyncio.get_running_loop()
        log.info("engine.loading", model=self.settings.model)
        try:
            # The flags' template is checked before the model loads: a typo fails in milliseconds.
            override = await asyncio.to_thread(
                template_override, self.settings.chat_template, self.settings.chat_template_file
            )
        except TemplateConfigError as exc:
            self.state, self.error = "failed", f"the chat template cannot be used: {exc}"
            log.error("engine.load_failed", model=self.settings.model, error=self.error)
            return
        try:
            if self.slot_dir is not None:
                self.slot_dir.mkdir(parents=True, exist_ok=True)
            # engine_config reads the model's header (its tensor types): off the event loop too.
            engine = await asyncio.to_thread(
                lambda: native.Engine(self.engine_config(), self._note_load_progress)
            )
        except (native.NativeError, OSError) as exc:
            self.state, self.error = "failed", f"the model failed to load: {type(exc).__name__}: {exc}"
            log.error("engine.load_failed", model=self.settings.model, error=self.error)
            return
        self.engine = engine
        engine.on_fault(self._on_fault)
        if self.state == "draining":  # SIGTERM while loading
            return
        model = engine.model
        choice = await asyncio.to_thread(select_template, override, model.chat_template)  # compiles jinja
        if not self.settings.jinja:
            log.warning("engine.no_jinja_ignored", reason="chat templates are always rendered as jinja here")
        if choice.fallback_reason:
            log.warning("engine.chat_template_fallback", reason=choice.fallback_reason, template="chatml")
        log.info("engine.chat_template", origin=choice.origin, chars=len(choice.source))
        self.template = ChatTemplate(
            choice.source,
            self.token_text(model.bos),
            self.token_text(model.eos),
            origin=choice.origin,
            write_calls=select_format(self.settings.chat_format, choice.source).write_calls,
            reasoning=self.settings.reasoning,
        )
        setting = self.settings.chat_format
        if setting in ("auto", UPSTREAM):
            ours = select_format(setting, choice.source) if setting == "auto" else None
            t = self.template
            writes = await asyncio.to_thread(lambda: t.caps.tool_calls)  # probe renders
            self.upstream = await asyncio.to_thread(
                UpstreamChat.for_template, choice.source, t.bos_token, t.eos_token, ours, writes
            )
        log.info(
            "engine.chat_format",
            format=UPSTREAM if self.upstream is not None else select_format(setting, choice.source).name,
            setting=setting,
        )
        self.leases.turn_slack = await asyncio.to_thread(
            self.template.generation_prompt_tokens, lambda text, special: engine.tokenize(text, special)
        )
        self.state = "ready"
        log.info(
            "engine.ready",
            model=self.settings.model,
            arch=model.arch,
            hybrid=model.hybrid,
            recurrent=model.recurrent,
            n_slots=self.settings.n_slots,
            repack=engine.config.repack,
            n_ctx_slot=engine.n_ctx_slot,
            kv_unified=engine.config.kv_unified,
            kv_streams=engine.kv_streams,
            cache_type_k=engine.config.cache_type_k,
            cache_type_v=engine.config.cache_type_v,
            context_shift=engine.config.context_shift,
            load_s=round(time.monotonic() - t0, 3),
        )

    def _note_load_progress(self, fraction: float) -> None:
        """From the loading thread: kept for /health, which the supervisor polls while it waits."""
        self.load_progress = fraction
        log.info("engine.load_progress", percent=int(fraction * 100))

    def _on_fault(self, reason: str) -> None:
        """The core's decode loop died (native/DESIGN.md, "Faults"): its requests have already
        ended with an error and it refuses everything, so only a new process can serve again.

        `failed` turns /health into a 500; the SIGTERM starts uvicorn's ordinary shutdown, after
        which engine_main exits 1 and the supervisor restarts the process. Only when a server has
        taken SIGTERM (engine_main does): an app run in-process by tests is left alone.
        """
        if self.state in ("failed", "closed"):
            return
        self.state, self.error = "failed", f"the native engine failed: {reason}"
        log.error("engine.fault", reason=reason)
        self.leases.close()
        if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None):
            signal.raise_signal(signal.SIGTERM)

    def request_drain(self) -> None:
        """Start draining (safe to call from a signal handler on the loop's thread)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        if self.state not in ("loading", "ready"):
            return
        log.info("engine.draining", previous=self.state, grace_s=self.settings.shutdown_grace_s)
        self.state = "draining"
        self.leases.close()
        loop = asyncio.get_running_loop()
        loop.call_later(self.settings.shutdown_grace_s, self._spawn, self._abort_inflight)

    def _spawn(self, fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
        task = asyncio.get_running_loop().create_task(fn())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _abort_inflight(self) -> None:
        engine = self.engine
        if engine is None:
            return
        busy = [s for s in await asyncio.to_thread(engine.slots) if s.request_id >= 0]
        for s in busy:
            log.warning("engine.abort_request", slot=s.id, request_id=s.request_id)
            await asyncio.to_thread(engine.cancel, s.request_id)

    async def cancel_slot(self, slot: int) -> bool:
        """Cancel the decode run on `slot` (its request ends as a cancelled one, with what
        it wrote so far); False when none runs there. The node uses it to delete a busy session and
        to drain without waiting for decode runs nobody will read."""
        engine = self.require()
        info = (await asyncio.to_thread(engine.slots))[slot]
        if info.request_id < 0:
            return False
        log.info("engine.cancel_request", slot=slot, request_id=info.request_id)
        return bool(await asyncio.to_thread(engine.cancel, info.request_id))

    def abort_on_slot(self, slot: int, request_id: int | None) -> None:
        """Cancel what the core still runs for us on `slot`, then end the slot's lease.

        Used when a decode run is left early (client gone, task cancelled). The facade's own cancel
        in `Engine.stream` is awaited inside the cancelled task and may never run (see DESIGN.md),
        so this one runs in a task of its own and holds the lease until the core has let go.
        """
        engine = self.engine

        def cancel() -> None:
            if engine is None:
                return
            rid = request_id
            for _ in range(1000):
                if rid is not None:
                    engine.cancel(rid)
                    return
                info = engine.slots()[slot]
                if info.request_id >= 0:
                    rid = info.request_id
                elif info.queued == 0:
                    return  # it already ended, or never reached the core
                else:
                    time.sleep(0.001)  # submitted, about to start: cancel it once it has an id

        async def run() -> None:
            try:
                await asyncio.to_thread(cancel)
            except native.NativeError as exc:
                log.warning("generation.abort_failed", slot=slot, error=str(exc))
            finally:
                self.leases.release(slot)

        self._spawn(run)

    @property
    def draining(self) -> bool:
        return self.state == "draining"

    async def close(self) -> None:
        self.leases.close()
        for task in list(self._tasks):
            task.cancel()
        engine, self.engine = self.engine, None
        if self.state != "failed":
            self.state = "closed"
        if engine is not None:
            # Pending core requests end with an error event; their streams report it.
            engine.close()
            log.info("engine.closed")

    # -- access ---------------------------------------------------------------------------------
    def require(self) -> native.Engine:
        """The loaded engine, or 503 (loading / failed / shutting down)."""
        if self.engine is not None and self.state == "ready":
            return self.engine
        if self.state == "loading":
            raise Unavailable("Loading model", retry_after=self.settings.retry_after_s)
        if self.state == "failed":
            raise ServerError(self.error)
        raise Unavailable("the engine is shutting down", retry_after=self.settings.retry_after_s)

    def token_text(self, token: int) -> str:
        if token < 0 or self.engine is None:
            return ""
        return self.engine.raw.token_piece(token, True).decode("utf-8", "replace")

    def tokenize(self, text: str, add_special: bool, parse_special: bool = True) -> list[int]:
        return self.require().tokenize(text, add_special, parse_special)

    async def _fetch_tokens(self, slot: int) -> list[int]:
        engine = self.engine
        if engine is None:
            raise Unavailable("the engine is closed")
        return await asyncio.to_thread(engine.slot_tokens, slot)

    def _core_metrics(self) -> dict[str, int] | None:
        return self.engine.metrics() if self.engine is not None else None

    def _gauges(self) -> dict[str, float]:
        return {
            "slotkeeper_engine_ready": 1.0 if self.state == "ready" else 0.0,
            "slotkeeper_slots_total": float(self.settings.n_slots),
            "slotkeeper_slots_busy": float(self.leases.n_busy()),
            "slotkeeper_queue_waiting": float(self.leases.n_waiting()),
        }

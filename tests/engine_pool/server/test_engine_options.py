"""llama-server's engine options reach the core of a real `slotkeeper engine` process: set through
SLOTKEEPER_* variables, checked at start (a flag the model cannot honour exits 1 with the reason),
and visible in what the engine serves."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from storage.slotfile.reader import read_slot_file

from ..conftest import EngineProcess

TEXT = "The quick brown fox jumps over the lazy dog while the clocks strike thirteen. " * 60


@pytest.fixture
def start(tmp_path: Path) -> Iterator:
    """`start(model, *args, **env)`: a started engine, stopped (cleanly) at the end of the test."""
    engines: list[EngineProcess] = []

    def run(model: Path, *args: str, **env: str) -> EngineProcess:
        eng = EngineProcess(model, *args, log_path=tmp_path / f"engine{len(engines)}.log", env=env)
        engines.append(eng)
        return eng.start()

    yield run
    for eng in engines:
        if eng.proc is not None and eng.proc.poll() is None:
            assert eng.stop() == 0, eng.log()[-4000:]


def _ready_event(eng: EngineProcess) -> dict[str, object]:
    for line in eng.log().splitlines():
        if '"engine.ready"' in line:
            return json.loads(line)
    raise AssertionError(f"no engine.ready in the log:\n{eng.log()[-4000:]}")


def test_kv_unified_gives_a_slot_the_whole_context(models: dict[str, Path], start) -> None:
    eng = start(models["llama"], "-np", "2", "-c", "1024", SLOTKEEPER_KV_UNIFIED="1")
    with httpx.Client(base_url=eng.url, timeout=60.0) as http:
        assert http.get("/props").json()["default_generation_settings"]["n_ctx"] == 1024
        tokens = http.post("/tokenize", json={"content": TEXT}).json()["tokens"][:700]
        r = http.post("/completion", json={"prompt": tokens, "n_predict": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["tokens_evaluated"] == 700
    ready = _ready_event(eng)
    assert ready["kv_unified"] is True and ready["n_ctx_slot"] == 1024


def test_q8_0_kv_cache_in_slot_files(models: dict[str, Path], start, tmp_path: Path) -> None:
    slots = tmp_path / "slots"
    q8_cache = {
        "SLOTKEEPER_CACHE_TYPE_K": "q8_0",
        "SLOTKEEPER_CACHE_TYPE_V": "q8_0",
        "SLOTKEEPER_FLASH_ATTN": "on",
    }
    q8 = start(models["llama"], "-c", "1024", "--slot-save-path", str(slots), **q8_cache)
    body = {"prompt": TEXT[:600], "n_predict": 4, "temperature": 0, "id_slot": 0}
    with httpx.Client(base_url=q8.url, timeout=60.0) as http:
        first = http.post("/completion", json=body).json()
        saved = http.post("/slots/0?action=save", json={"filename": "q8.slot"})
        assert saved.status_code == 200, saved.text
        assert http.post("/slots/0?action=erase").status_code == 200
        restored = http.post("/slots/0?action=restore", json={"filename": "q8.slot"})
        assert restored.status_code == 200, restored.text
        again = http.post("/completion", json=body).json()
        assert again["content"] == first["content"] and again["tokens_evaluated"] == first["tokens_evaluated"]
    ctx = read_slot_file(slots / "q8.slot").meta["context"]
    assert (ctx["type_k"], ctx["type_v"]) == ("q8_0", "q8_0")

    # An f16 engine refuses the file by name and serves the prompt from scratch instead.
    f16 = start(models["llama"], "-c", "1024", "--slot-save-path", str(slots))
    with httpx.Client(base_url=f16.url, timeout=60.0) as http:
        r = http.post("/slots/0?action=restore", json={"filename": "q8.slot"})
        assert r.status_code == 400, r.text
        assert "shape_mismatch" in r.text and "k=q8_0 v=q8_0" in r.text
        fresh = http.post("/completion", json=body).json()
        assert fresh["timings"]["cache_n"] == 0 and fresh["content"] == first["content"]


def test_load_flags_start_and_serve(models: dict[str, Path], start) -> None:
    eng = start(models["qwen35"], SLOTKEEPER_NO_MMAP="1", SLOTKEEPER_MLOCK="1", SLOTKEEPER_NO_WARMUP="1")
    with httpx.Client(base_url=eng.url, timeout=60.0) as http:
        r = http.post("/completion", json={"prompt": "Hello there", "n_predict": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 3


@pytest.mark.parametrize(
    ("arch", "env", "why"),
    [
        (
            "qwen35",
            {"SLOTKEEPER_CONTEXT_SHIFT": "1"},
            "--context-shift cannot be used with this model (qwen35, hybrid)",
        ),
        ("llama", {"SLOTKEEPER_CACHE_TYPE_V": "q8_0"}, "--cache-type-v q8_0 needs flash attention"),
    ],
)
def test_options_the_engine_cannot_honour_stop_it(
    models: dict[str, Path], tmp_path: Path, arch, env, why
) -> None:
    eng = EngineProcess(models[arch], log_path=tmp_path / "engine.log", env=env)
    with pytest.raises(RuntimeError, match="engine exited with 1"):
        eng.start()
    assert why in eng.log()


def test_context_shift_on_an_attention_model(models: dict[str, Path], start) -> None:
    eng = start(models["llama"], "-c", "256", SLOTKEEPER_CONTEXT_SHIFT="1")
    with httpx.Client(base_url=eng.url, timeout=60.0) as http:
        body = {"prompt": TEXT[:200], "n_predict": 250, "temperature": 0, "ignore_eos": True}
        r = http.post("/completion", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["tokens_evaluated"] + out["tokens_predicted"] > 256  # past the context: shifted
        assert out["tokens_predicted"] == 250 and out["stop_type"] == "limit"

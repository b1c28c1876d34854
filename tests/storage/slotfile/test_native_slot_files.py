"""The pure-Python reader against files written by the real native engine."""

from __future__ import annotations

import json
from pathlib import Path

import native
from storage.slotfile.inspect import main as inspect_main
from storage.slotfile.reader import read_slot_file, read_tokens, verify_slot_file


def test_reader_agrees_with_the_native_writer(tiny_model, tmp_path: Path, capsys):
    eng = native.Engine(native.EngineConfig(tiny_model("qwen35"), n_ctx=1024, checkpoint_interval=64))
    try:
        p = native.RequestParams(eng.tokenize("The quick brown fox jumps over the lazy dog. " * 20))
        p.n_predict, p.temperature, p.checkpoint_hints = 4, 0.0, [30]
        eng.generate(0, p)
        path = tmp_path / "s.slot"
        info = eng.save_slot(0, str(path))
        sf = read_slot_file(path)
        assert sf.checksum_ok
        assert sf.fingerprint == eng.model.fingerprint and sf.arch == "qwen35"
        assert read_tokens(sf) == eng.slot_tokens(0)
        assert len(sf.checkpoints) == info.n_checkpoints
        assert [c.n_tokens for c in sf.checkpoints] == [c["n_tokens"] for c in sf.meta["checkpoints"]]
        assert sum(sf.sizes.values()) == path.stat().st_size == info.n_bytes
        verify_slot_file(path, fingerprint=eng.model.fingerprint)
        assert inspect_main([str(path), "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["valid"] is True and out["checksum"]["ok"] is True
    finally:
        eng.close()

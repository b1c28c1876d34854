"""``slotkeeper inspect`` (storage.slotfile.inspect.main)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from storage.slotfile.inspect import main


def test_human_output(tmp_path: Path, slot_writer: Any, capsys: pytest.CaptureFixture[str]) -> None:
    spec = slot_writer.Spec(checkpoints=[(2, 0, 1, b"T" * 3000), (5, 0, 4, b"")], ckpt_logits=[])
    path = slot_writer.write(tmp_path / "a.slot", spec)
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "ab" * 32 in out and "qwen35 (hybrid" in out and "tokens       6" in out
    assert "checkpoints  2" in out and "n_tokens 2" in out and "2.93 KiB (3000 B)" in out
    assert "checksum     ok" in out and f"({path.stat().st_size} B)" in out


def test_json_output(tmp_path: Path, slot_writer: Any, capsys: pytest.CaptureFixture[str]) -> None:
    path = slot_writer.write(tmp_path / "a.slot", slot_writer.Spec())
    assert main([str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["valid"] is True and info["n_tokens"] == 6 and info["model"]["arch"] == "qwen35"
    assert info["checkpoints"] == [
        {
            "n_tokens": 2,
            "pos_min": 0,
            "pos_max": 1,
            "target_bytes": 24,
            "draft_bytes": 0,
            "spec_bytes": 0,
            "kind": "prompt_end",
        }
    ]
    sizes = info["sizes"]
    assert (
        sizes["base"] + sizes["checkpoints"] + sizes["metadata"] + sizes["logits"] + sizes["trailer"]
        == info["size"]
    )
    assert info["checksum"]["ok"] is True and info["checksum"]["stored"] == info["checksum"]["computed"]


def test_checksum_mismatch(tmp_path: Path, slot_writer: Any, capsys: pytest.CaptureFixture[str]) -> None:
    path = slot_writer.write(tmp_path / "a.slot", slot_writer.Spec(body_crc=1))
    assert main([str(path)]) == 1
    assert "MISMATCH" in capsys.readouterr().out
    assert main([str(path), "--no-checksum"]) == 0
    assert "not checked" in capsys.readouterr().out


def test_invalid_and_missing(tmp_path: Path, slot_writer: Any, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cut.slot"
    path.write_bytes(slot_writer.build(slot_writer.Spec())[:-10])
    assert main([str(path), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["valid"] is False and out["error"]["kind"] == "truncated"
    assert main([str(path)]) == 1 and "truncated" in capsys.readouterr().err
    assert main([str(tmp_path / "nope.slot")]) == 2
    with pytest.raises(SystemExit):
        main([])


def test_a_name_that_is_neither_a_file_nor_a_stored_session_says_what_to_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sess-1", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "'sess-1' is no file" in err and "no local store" in err and "--data-dir" in err
    (tmp_path / "blobs" / "slotkeeper" / "acme" / "s1").mkdir(parents=True)
    (tmp_path / "blobs" / "slotkeeper" / "acme" / ".chunks").mkdir()  # the tenant's pieces: no session
    assert main(["sess-1", "--data-dir", str(tmp_path)]) == 2  # the open tenant has nothing here
    assert "pass --tenant with one of: acme" in capsys.readouterr().err
    assert main(["s2", "--tenant", "acme", "--data-dir", str(tmp_path)]) == 2
    assert "its stored sessions: s1 (" in capsys.readouterr().err
    assert main(["../x", "--data-dir", str(tmp_path)]) == 2  # no id can name a path
    assert "no session id" in capsys.readouterr().err

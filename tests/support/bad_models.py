"""Model files that fail in a given way, for the tests of what a start does with them."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


def unloadable_model(path: Path) -> str:
    """A GGUF whose header and tensors are sound, of an architecture llama.cpp does not know: it
    passes the model check and fails to load in every engine started on it."""
    w = gguf.GGUFWriter(str(path), "notanarch")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)

"""The engine's slot-action answers: llama-server's shapes, read back by the node agent."""

from __future__ import annotations

import pytest

from engine_pool.protocol.codec import WireError
from engine_pool.protocol.slot_actions import (
    RestoreTimings,
    SaveTimings,
    SlotCancelled,
    SlotErased,
    SlotRestored,
    SlotSaved,
)


def test_answers_are_llama_servers_shapes_and_read_back() -> None:
    saved = SlotSaved(1, "a.slot", 40, 4096, 2, SaveTimings(1.5))
    assert saved.to_json() == {
        "id_slot": 1,
        "filename": "a.slot",
        "n_saved": 40,
        "n_written": 4096,
        "n_checkpoints": 2,
        "timings": {"save_ms": 1.5},
    }
    restored = SlotRestored(1, "a.slot", 40, 4096, 2, RestoreTimings(0.5))
    assert restored.to_json()["timings"] == {"restore_ms": 0.5}
    for answer in (saved, restored, SlotErased(0, 12), SlotCancelled(0, False)):
        assert type(answer).from_json(answer.to_json()) == answer


def test_an_answer_missing_a_field_is_named() -> None:
    with pytest.raises(WireError) as err:
        SlotRestored.from_json({"id_slot": 0, "filename": "a", "n_restored": 1, "n_checkpoints": 0})
    assert err.value.field == "n_read"

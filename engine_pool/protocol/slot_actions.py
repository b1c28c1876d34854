"""The engine's slot actions as its node agent calls them, answered as llama-server answers them:
`POST /slots/{id}?action=save|restore|erase|cancel`. Each answer is defined once, for the engine
(`engine_pool.server.slot_files`, which writes it with `to_json`) and the agent
(`engine_pool.pool.agent`, which reads it with `from_json`): the one codec (`codec`). Each answer
names the action it answers (`action`), so the agent asks for an answer and the action follows.

A save or restore names its file (`filename`, a plain name inside the engine's slot directory) and
the slot's label beside it (`slot_owner` with `slot_expect` for a save, `slot_session` for a
restore: Slotkeeper's additions, which llama-server does not have).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, TypeVar

from .codec import Wire


@dataclass(frozen=True)
class SaveTimings(Wire):
    save_ms: float


@dataclass(frozen=True)
class RestoreTimings(Wire):
    restore_ms: float


@dataclass(frozen=True)
class SlotSaved(Wire):
    """The slot's state written to `filename`: its tokens, the file's bytes, its checkpoints."""

    action: ClassVar[str] = "save"
    id_slot: int
    filename: str
    n_saved: int
    n_written: int
    n_checkpoints: int
    timings: SaveTimings


@dataclass(frozen=True)
class SlotRestored(Wire):
    """`filename` loaded into the slot: its tokens, the bytes read, its checkpoints."""

    action: ClassVar[str] = "restore"
    id_slot: int
    filename: str
    n_restored: int
    n_read: int
    n_checkpoints: int
    timings: RestoreTimings


@dataclass(frozen=True)
class SlotErased(Wire):
    action: ClassVar[str] = "erase"
    id_slot: int
    n_erased: int  # the tokens the slot held


@dataclass(frozen=True)
class SlotCancelled(Wire):
    action: ClassVar[str] = "cancel"
    id_slot: int
    cancelled: bool  # False when no generation ran on the slot


SlotAnswer = TypeVar("SlotAnswer", SlotSaved, SlotRestored, SlotErased, SlotCancelled)  # `action` names it

"""The one rule for the generation a save is stored as, used by every saver.

A session's stored versions ("generations") are numbered once per session id, never reused, not
even across a delete and a reuse of the id (storage.index.session_index). The number a save uses
is the one the index hands out (:meth:`SessionIndex.reserve_generation`, or its ``decide_reserve``
transition written under the session's hold): above the durable one, above every one handed out
already, above every one a deleted namesake used. Handing it out is a record write, so two savers
of one session (a gateway's write-behind save, a node's drain) never get the same number.

A number handed out may still be taken where the save lands: a copy a crash left in a node's spill
cache or the store, written but never recorded. Such a copy is never overwritten; the save asks for
the next number instead, at most :data:`GENERATION_TRIES` times in a row.

The savers: the gateway's write-behind save and eviction (gateway.turn.save, gateway.turn.evict), and a
node's drain (engine_pool.pool.agent). Each says how it reserves, how it saves and how a taken
generation shows (its own error); this module owns the loop and its bound.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from storage.errors import WriteConflict

T = TypeVar("T")

GENERATION_TRIES = 8  # generations found taken in a row before a save gives up


class GenerationsTaken(WriteConflict):
    """Every generation the save was handed was taken already where it lands."""


async def save_as_next_generation(
    session: str,
    reserve: Callable[[], Awaitable[int]],
    save: Callable[[int], Awaitable[T]],
    taken: Callable[[Exception], bool],
) -> T:
    """``save(generation)``'s result for the first generation ``reserve()`` hands out that is not
    taken (``taken(error)``: the error ``save`` raised says the generation is held already).
    Raises :class:`GenerationsTaken` after :data:`GENERATION_TRIES` taken ones; any other error of
    ``save`` or ``reserve`` leaves as it is."""
    for _ in range(GENERATION_TRIES):
        generation = await reserve()
        try:
            return await save(generation)
        except Exception as exc:
            if not taken(exc):
                raise
    raise GenerationsTaken(f"session {session}: {GENERATION_TRIES} generations in a row are taken")

"""storage.index.generations: the one rule every saver follows for the generation a save is stored as,
on the in-process index (the gateway's saves and a node's drain share it)."""

from __future__ import annotations

import fakeredis
import pytest

from storage.errors import WriteConflict
from storage.index.generations import GENERATION_TRIES, GenerationsTaken, save_as_next_generation
from storage.index.session_index import SessionIndex


class Taken(Exception):
    """A saver's own word for a generation held already where the save lands."""


@pytest.fixture
async def index():
    redis = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    yield SessionIndex(redis)
    await redis.aclose()


async def test_a_save_skips_taken_generations_for_the_next_ones_the_index_hands_out(index) -> None:
    await index.create("t", "s", model="m")
    await index.set_durable("t", "s", generation=3, blob_key="k", nbytes=1)
    tried: list[int] = []

    async def save(generation: int) -> int:
        tried.append(generation)
        if generation < 6:  # copies a crash left, never recorded
            raise Taken
        return generation

    reserve = lambda: index.reserve_generation("t", "s")  # noqa: E731
    assert await save_as_next_generation("s", reserve, save, lambda e: isinstance(e, Taken)) == 6
    assert tried == [4, 5, 6]
    assert (await index.get("t", "s")).next_generation == 7  # every number handed out stays used


async def test_a_save_gives_up_after_its_tries_and_other_errors_leave_at_once(index) -> None:
    await index.create("t", "s", model="m")

    async def always_taken(generation: int) -> int:
        raise Taken

    reserve = lambda: index.reserve_generation("t", "s")  # noqa: E731
    with pytest.raises(GenerationsTaken) as err:
        await save_as_next_generation("s", reserve, always_taken, lambda e: isinstance(e, Taken))
    assert isinstance(err.value, WriteConflict) and f"{GENERATION_TRIES} generations" in str(err.value)
    assert (await index.get("t", "s")).reserved == GENERATION_TRIES

    async def broken(generation: int) -> int:
        raise RuntimeError("store down")

    with pytest.raises(RuntimeError):
        await save_as_next_generation("s", reserve, broken, lambda e: isinstance(e, Taken))
    assert (await index.get("t", "s")).reserved == GENERATION_TRIES + 1


async def test_two_savers_of_one_session_never_get_the_same_generation(index) -> None:
    """A gateway's write-behind save reserved a number it has not recorded yet; a node's drain that
    saves the same session meanwhile gets the next one, not a collision."""
    await index.create("t", "s", model="m")
    await index.set_durable("t", "s", generation=2, blob_key="k", nbytes=1)
    gateway = await index.reserve_generation("t", "s")

    async def save(generation: int) -> int:
        return generation

    drained = await save_as_next_generation(
        "s", lambda: index.reserve_generation("t", "s"), save, lambda e: False
    )
    assert (gateway, drained) == (3, 4)

"""Stored responses: round trip, tenant scoping, damaged documents read as not found."""

from __future__ import annotations

from pathlib import Path

import pytest

from storage.blobs.localstore import LocalStore
from storage.blobs.stored_responses import KIND, ResponseStore, StoredResponse, new_response_id
from storage.errors import NotStored


def stored(tenant: str = "acme", session: str = "s-1") -> StoredResponse:
    return StoredResponse(
        new_response_id(),
        tenant,
        session,
        "qwen35",
        {"id": "x", "object": "response", "output": []},
        [{"id": "msg_1", "type": "message", "role": "user", "content": "a"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    )


@pytest.fixture
def responses(tmp_path: Path) -> ResponseStore:
    return ResponseStore(LocalStore(tmp_path / "store", prefix="p", fsync=False))


async def test_round_trip_and_delete(responses: ResponseStore) -> None:
    r = stored()
    await responses.save(r)
    assert await responses.load("acme", r.id) == r
    with pytest.raises(NotStored):
        await responses.load("other", r.id)  # another tenant's id is simply not found
    with pytest.raises(NotStored):
        await responses.delete("other", r.id)
    await responses.delete("acme", r.id)
    with pytest.raises(NotStored):
        await responses.load("acme", r.id)
    with pytest.raises(NotStored):
        await responses.delete("acme", r.id)


@pytest.mark.parametrize("bad_id", ["../../etc/passwd", "", ".x", "a" * 200, "a:b"])
async def test_ids_that_cannot_be_ids_are_not_found(responses: ResponseStore, bad_id: str) -> None:
    with pytest.raises(NotStored):
        await responses.load("acme", bad_id)


@pytest.mark.parametrize(
    "damage",
    [
        b"not json",
        b"[]",
        b'{"version": 99}',
        # a copy of another tenant's document placed under this tenant's name
        None,
    ],
)
async def test_damaged_or_foreign_documents_read_as_not_found(
    responses: ResponseStore, damage: bytes | None
) -> None:
    r = stored()
    if damage is None:
        foreign = stored(tenant="evil")
        data = foreign.encode().replace(foreign.id.encode(), r.id.encode())
    else:
        data = damage
    await responses.store.put_document("acme", KIND, r.id, data)
    with pytest.raises(NotStored, match="damaged"):
        await responses.load("acme", r.id)


async def test_a_session_id_that_could_address_a_path_is_refused(responses: ResponseStore) -> None:
    r = stored()
    data = r.encode().replace(b'"session":"s-1"', b'"session":"../x"')
    await responses.store.put_document("acme", KIND, r.id, data)
    with pytest.raises(NotStored):
        await responses.load("acme", r.id)

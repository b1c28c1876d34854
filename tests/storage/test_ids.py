"""storage.ids: the one validation function, and blob keys that cannot escape a tenant."""

from __future__ import annotations

import pytest

from storage.errors import InvalidId
from storage.ids import (
    MAX_ID_LEN,
    SlotRef,
    blob_key,
    parse_blob_key,
    tenant_prefix,
    validate_id,
    validate_prefix,
)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("", "is empty"),
        ("a/b", "path separator"),
        ("a\\b", "path separator"),
        ("..", "'..'"),
        ("a..b", "'..'"),
        (".hidden", "starts with '.'"),
        ("a\0b", "NUL"),
        ("x" * (MAX_ID_LEN + 1), "limit is 128"),
        ("a:b", "contains ':'"),
        ("a b", "contains ' '"),
        ("é", "contains 'é'"),
        (7, "must be a string"),
    ],
)
def test_rejected_ids(value: object, reason: str) -> None:
    with pytest.raises(InvalidId) as info:
        validate_id(value, "session id")
    assert reason in str(info.value) and info.value.what == "session id" and info.value.status == 400


@pytest.mark.parametrize(
    "value", ["a", "x" * MAX_ID_LEN, "Tenant-1_b.c~d@e+f=g", "550e8400-e29b-41d4-a716-446655440000"]
)
def test_accepted_ids(value: str) -> None:
    assert validate_id(value) == value


def test_keys_round_trip() -> None:
    ref = SlotRef("acme", "s1", 42)
    key = blob_key("slotkeeper/prod", ref)
    assert key == "slotkeeper/prod/acme/s1/00000000000000000042.slot"
    assert parse_blob_key("slotkeeper/prod", key) == ref
    assert (
        blob_key("", ref) == "acme/s1/00000000000000000042.slot"
        and parse_blob_key("", blob_key("", ref)) == ref
    )
    assert tenant_prefix("p", "acme") == "p/acme/" and tenant_prefix("p", "acme", "s1") == "p/acme/s1/"
    for foreign in (
        "other/acme/s1/00000000000000000042.slot",
        "slotkeeper/prod/acme/s1/42.slot",
        "slotkeeper/prod/acme/s1/x/00000000000000000042.slot",
        "slotkeeper/prod/.probe/00000000000000000042.slot",
    ):
        assert parse_blob_key("slotkeeper/prod", foreign) is None


def test_refs_and_prefixes_are_validated() -> None:
    for bad in (("../a", "s", 1), ("a", "s/..", 1), ("a", "s", -1), ("a", "s", 10**20), ("a", "s", True)):
        with pytest.raises(InvalidId):
            SlotRef(*bad)  # type: ignore[arg-type]
    assert validate_prefix("a/b") == "a/b" and validate_prefix("") == ""
    for bad_prefix in ("/a", "a/", "a//b", "a/../b"):
        with pytest.raises(InvalidId):
            validate_prefix(bad_prefix)

"""The one codec for wire payloads: what it writes reads back, and every refusal names its field."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from engine_pool.errors import BadRequest
from engine_pool.http.body import Body
from engine_pool.protocol.codec import Wire, WireError, decode, encode, wire


@dataclass(frozen=True)
class Part(Wire):
    name: str
    size: int = field(metadata=wire(lo=0, hi=100))


@dataclass(frozen=True)
class Whole(Wire):
    label: str = field(metadata=wire(absent="?"))
    parts: tuple[Part, ...] = field(metadata=wire(max_items=3))
    ratio: float = 1.0
    note: str | None = None
    tags: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Ask(Wire):
    sparse = True

    who: str
    count: int = 1
    ids: list[int] | None = None
    flag: bool = False


def test_a_payload_reads_back_what_it_writes() -> None:
    whole = Whole("w", (Part("a", 1), Part("b", 2)), 0.5, "n", {"k": "v"})
    data = encode(whole)
    assert data == {
        "label": "w",
        "parts": [{"name": "a", "size": 1}, {"name": "b", "size": 2}],
        "ratio": 0.5,
        "note": "n",
        "tags": {"k": "v"},
    }
    assert Whole.from_json(data) == whole
    assert whole.to_json() == data


def test_absent_and_null_take_defaults_and_none() -> None:
    got = Whole.from_json({"parts": [], "ratio": None, "note": None})
    assert got == Whole("?", (), 1.0, None, {})
    assert Whole.from_json({"parts": [], "ratio": 2}).ratio == 2.0  # an integer is a number
    assert Part.from_json({"name": "a", "size": 3.0}).size == 3  # an integral float is an integer


def test_a_sparse_payload_leaves_its_defaults_out() -> None:
    assert Ask("x").to_json() == {"who": "x"}
    assert Ask("x", ids=[]).to_json() == {"who": "x"}  # an empty array where the default is None
    assert Ask("x", 2, [1], True).to_json() == {"who": "x", "count": 2, "ids": [1], "flag": True}
    assert Ask.from_body(Body(Ask("x", 2, [1], True).to_json())) == Ask("x", 2, [1], True)


@pytest.mark.parametrize(
    ("data", "field_path", "message"),
    [
        ({}, "parts", "'parts' is required"),
        ({"parts": "x"}, "parts", "'parts' must be an array, got string"),
        ({"parts": [{}] * 4}, "parts", "'parts' holds 4 items, more than 3"),
        ({"parts": [{"name": "a", "size": 1}, {"size": 1}]}, "parts[1].name", "'parts[1].name' is required"),
        ({"parts": [{"name": "a", "size": True}]}, "parts[0].size", "must be an integer, got boolean"),
        ({"parts": [{"name": "a", "size": 101}]}, "parts[0].size", "must be within 0..100, got 101"),
        ({"parts": [{"name": "a", "size": 1.5}]}, "parts[0].size", "must be an integer, got number"),
        ({"parts": [], "ratio": "1"}, "ratio", "'ratio' must be a number, got string"),
        ({"parts": [], "tags": {"k": 1}}, "tags.k", "'tags.k' must be a string, got integer"),
        ({"parts": [7]}, "parts[0]", "'parts[0]' must be an object, got integer"),
    ],
)
def test_a_malformed_object_is_refused_naming_the_field(
    data: dict[str, Any], field_path: str, message: str
) -> None:
    with pytest.raises(WireError) as err:
        decode(Whole, data)
    assert err.value.field == field_path
    assert message in str(err.value)


def test_every_required_field_is_named_before_any_type() -> None:
    with pytest.raises(WireError) as err:
        Part.from_json({"name": 5})
    assert err.value.field == "size"


def test_from_body_is_a_400_with_the_bodys_path() -> None:
    with pytest.raises(BadRequest) as err:
        Ask.from_body(Body({"who": "x", "flag": "yes"}, "outer"))
    assert err.value.param == "outer.flag"
    assert err.value.status == 400
    with pytest.raises(WireError):  # another service's answer: not the caller's 400
        Ask.from_json({"who": 1})

"""What the gateway sends an engine: the tenant's bytes with its own fields set, read by the
engine's parser exactly as the merged object."""

from __future__ import annotations

import json

import pytest

from engine_pool.http.body import parse_json_object
from gateway.turn.engine_call import engine_body

FIELDS = {"id_slot": 3, "model": "served", "cache_prompt": True}
BODIES = [
    b'{"model":"m","messages":[{"role":"user","content":"hi"}]}',
    b'  {\n "model": "m", "id_slot": 0, "cache_prompt": false }\r\n\t',
    b"{}",
    b"{ }",
    b'{"a":{"b":[1,2,{}]},"s":"}","t":"{"}',
    '{"content":"Grüße, 世界 \\u2028"}'.encode(),
    b'{"id_slot":0,"id_slot":1}',
]


@pytest.mark.parametrize("raw", BODIES)
def test_the_engine_reads_the_tenants_object_with_the_gateways_fields(raw: bytes) -> None:
    body = json.loads(raw)
    sent = engine_body(raw, body, FIELDS)
    assert parse_json_object(sent) == {**body, **FIELDS}
    start = raw.strip()[:-1].rstrip()
    assert sent.startswith(start)  # passed on as it came, not encoded again


def test_a_field_set_to_none_is_gone_for_the_engine() -> None:
    raw = b'{"model":"m","prompt_cache_key":"theirs","x":null}'
    sent = parse_json_object(engine_body(raw, json.loads(raw), {"prompt_cache_key": None, "id_slot": 1}))
    assert sent.get("prompt_cache_key") is None and sent["id_slot"] == 1 and "x" in sent


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32-le", "utf-8-sig"])
def test_bodies_in_other_encodings_are_encoded_from_the_parsed_object(encoding: str) -> None:
    text = '{"model":"m","id_slot":0,"prompt_cache_key":"k","messages":["Grüße"]}'
    raw = text.encode(encoding)
    body = json.loads(raw)
    sent = engine_body(raw, body, {"id_slot": 2, "prompt_cache_key": None})
    assert json.loads(sent.decode("utf-8")) == {"model": "m", "id_slot": 2, "messages": ["Grüße"]}


def test_without_the_tenants_bytes_the_object_is_encoded() -> None:
    assert json.loads(engine_body(None, {"a": 1, "b": None}, {"a": 2, "c": None})) == {"a": 2, "b": None}
    assert engine_body(b'{"a":1}', {"a": 1}, {}) == b'{"a":1}'

"""Tenants file parsing and key authentication."""

from __future__ import annotations

import pytest

from gateway.tenants import Durability, TenantConfigError, key_digest, load_tenants, parse_tenants
from storage.errors import InvalidId


def test_keys_are_hashed_and_authenticate_their_tenant(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(
        '[tenants.acme]\nkeys = ["sk-a"]\ndurability = "on-evict"\nmodels = { "gpt-4o" = "qwen35" }\n'
        "[tenants.acme.quotas]\nlive_slots = 2\n"
        f'[tenants.beta]\nkey_sha256 = ["{key_digest("sk-b")}"]\n'
    )
    tenants = load_tenants(path)
    acme = tenants.authenticate("sk-a")
    assert acme is not None and acme.name == "acme" and acme.durability is Durability.ON_EVICT
    assert "sk-a" not in repr(acme)
    assert acme.quotas.live_slots == 2 and acme.quotas.sessions is None
    assert acme.model_id("gpt-4o", {"qwen35"}) == "qwen35"
    assert acme.model_id("nope", {"qwen35"}) is None
    assert tenants.authenticate("sk-b").name == "beta"  # type: ignore[union-attr]
    assert tenants.authenticate("sk-c") is None
    assert tenants.authenticate(None) is None
    assert load_tenants(None).authenticate(None).name == "default"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "doc, message",
    [
        ({}, "at least one"),
        ({"tenants": {"a": {}}}, "no keys"),
        ({"tenants": {"a": {"keys": ["k"]}, "b": {"keys": ["k"]}}}, "shares a key"),
        ({"tenants": {"a": {"keys": ["k"], "durability": "sometimes"}}}, "durability"),
        ({"tenants": {"a": {"keys": ["k"], "quotas": {"sessions": -1}}}}, "quotas.sessions"),
    ],
)
def test_bad_tenant_files_name_the_problem(doc, message):
    with pytest.raises(TenantConfigError, match=message):
        parse_tenants(doc)


def test_tenant_names_are_ids():
    with pytest.raises(InvalidId):
        parse_tenants({"tenants": {"../x": {"keys": ["k"]}}})

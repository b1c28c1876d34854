"""Tenants file parsing and key authentication."""

from __future__ import annotations

import pytest

from gateway.tenants import (
    Durability,
    HostedTools,
    StoreOutage,
    TenantConfigError,
    key_digest,
    load_tenants,
    open_tenants,
    parse_tenants,
)
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
        ({"tenants": {"a": {"keys": ["k"], "storage": 3}}}, "storage must be a table"),
        ({"tenants": {"a": {"keys": ["k"], "storage": {"share": True}}}}, "unknown keys: share"),
        ({"tenants": {"a": {"keys": ["k"], "storage": {"share_chunks": "no"}}}}, "share_chunks"),
        ({"tenants": {"a": {"keys": ["k"], "storage": {"idle_ttl_s": 0}}}}, "idle_ttl_s"),
        ({"tenants": {"a": {"keys": ["k"], "storage": {"idle_ttl_s": True}}}}, "idle_ttl_s"),
        ({"tenants": {"a": {"keys": ["k"], "storage": {"on_store_outage": "drop"}}}}, "on_store_outage"),
        (
            {"tenants": {"a": {"keys": ["k"], "hosted_tools": "run"}}},
            "tenants.a.hosted_tools must be 'omit' or 'refuse'",
        ),
        (
            {"tenants": {"a": {"keys": ["k"], "volatile": [{"name": "all", "pattern": ".*"}]}}},
            "matches every line",
        ),
        ({"tenants": {"a": {"keys": ["k"], "volatile": [{"name": "x", "pattern": "("}]}}}, r"volatile\[0\]"),
        ({"tenants": {"a": {"keys": ["k"], "volatile": {"name": "x"}}}}, "array of tables"),
        (
            {"tenants": {"a": {"keys": ["k"], "volatile": [{"name": "x", "pattern": "a", "when": 1}]}}},
            "unknown keys",
        ),
        (
            {
                "tenants": {
                    "a": {"keys": ["k"], "volatile": [{"name": "claude-code-billing", "pattern": "a"}]}
                }
            },
            "exists already",
        ),
        (
            {
                "tenants": {
                    "a": {"keys": ["k"], "volatile": [{"name": f"r{i}", "pattern": "a"} for i in range(33)]}
                }
            },
            "limit is 32",
        ),
        ({"tenants": {"a": {"keys": ["k"], "volatile_builtins": "no"}}}, "volatile_builtins"),
    ],
)
def test_bad_tenant_files_name_the_problem(doc, message):
    with pytest.raises(TenantConfigError, match=message):
        parse_tenants(doc)


def test_storage_settings_per_tenant():
    tenants = parse_tenants(
        {
            "tenants": {
                "a": {
                    "keys": ["ka"],
                    "storage": {"share_chunks": False, "idle_ttl_s": 86400, "on_store_outage": "reprefill"},
                },
                "b": {"keys": ["kb"]},
            }
        }
    )
    a, b = tenants.by_name["a"], tenants.by_name["b"]
    assert (a.share_chunks, a.idle_ttl_s, a.store_outage) == (False, 86400.0, StoreOutage.REPREFILL)
    # shared, kept until deleted, waited for while the store is down
    assert (b.share_chunks, b.idle_ttl_s, b.store_outage) == (True, None, StoreOutage.WAIT)


def test_hosted_tools_are_omitted_unless_the_tenant_refuses_them():
    tenants = parse_tenants(
        {"tenants": {"a": {"keys": ["ka"], "hosted_tools": "refuse"}, "b": {"keys": ["kb"]}}}
    )
    assert tenants.by_name["a"].hosted_tools is HostedTools.REFUSE
    assert tenants.by_name["b"].hosted_tools is HostedTools.OMIT
    assert open_tenants().by_name["default"].hosted_tools is HostedTools.OMIT


def test_tenant_names_are_ids():
    with pytest.raises(InvalidId):
        parse_tenants({"tenants": {"../x": {"keys": ["k"]}}})


def test_model_names_agents_send_find_the_served_model():
    tenants = parse_tenants(
        {
            "tenants": {
                "a": {
                    "keys": ["k"],
                    "models": {"gpt-4o": "llama", "claude-*": "qwen35", "claude-opus-*": "llama"},
                }
            }
        }
    )
    a = tenants.by_name["a"]
    served = {"qwen35", "llama"}
    assert a.model_id("gpt-4o", served) == "llama"  # exact alias
    assert a.model_id("claude-opus-4-1", served) == "qwen35"  # first matching pattern, file order
    assert a.model_id("qwen35", served) == "qwen35"  # ids as they are
    assert a.model_id("gpt-5", served) is None  # with a tenants file, nothing else
    assert a.model_id("claude-x", {"llama"}) is None  # the pattern's target is not served
    open_tenant = load_tenants(None).by_name["default"]
    assert open_tenant.model_id("claude-sonnet-4-5", {"qwen35"}) == "qwen35"  # one model: any name
    assert open_tenant.model_id("claude-sonnet-4-5", served) is None  # several: names must match
    assert open_tenant.model_id("llama", served) == "llama"


def test_volatile_rules_follow_the_built_in_ones_unless_turned_off(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(
        '[tenants.a]\nkeys = ["ka"]\n'
        '[[tenants.a.volatile]]\nname = "stamp"\npattern = "^Request: [0-9a-f]{8}$"\naction = "move_end"\n'
        '[tenants.b]\nkeys = ["kb"]\nvolatile_builtins = false\n'
    )
    tenants = load_tenants(path)
    a, b = tenants.by_name["a"], tenants.by_name["b"]
    assert [(r.name, r.action, r.scope) for r in a.volatile] == [
        ("claude-code-billing", "drop", "system"),
        ("stamp", "move_end", "system"),
    ]
    assert b.volatile == ()
    assert [r.name for r in load_tenants(None).by_name["default"].volatile] == ["claude-code-billing"]
